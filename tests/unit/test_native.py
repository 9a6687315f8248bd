"""The per-call modules run compiled (what `make native` builds is what the tests run), and
a compiled module older than its source is found, so importing qosgate refuses to run it."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import pathlib

from qosgate import native

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def test_every_listed_module_is_imported_compiled() -> None:
    assert native.compiled()
    for name in native.MODULES:
        module = importlib.import_module("qosgate." + name.removesuffix(".py").replace("/", "."))
        assert module.__file__ is not None and module.__file__.endswith(SUFFIX), module.__file__


def _package(tmp_path: pathlib.Path, *, built: bool) -> pathlib.Path:
    for name in native.MODULES:
        source = tmp_path / name
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        os.utime(source, (1_000, 1_000))
        if built:
            extension = source.with_name(source.stem + SUFFIX)
            extension.write_bytes(b"")
            os.utime(extension, (2_000, 2_000))
    return tmp_path


def test_a_module_edited_after_its_build_is_stale(tmp_path: pathlib.Path) -> None:
    package = _package(tmp_path, built=True)
    assert native.compiled(package) and native.stale(package) == []
    edited = native.MODULES[3]
    os.utime(package / edited, (3_000, 3_000))
    assert native.stale(package) == [edited]


def test_source_without_extension_modules_runs_interpreted_and_is_not_stale(
    tmp_path: pathlib.Path,
) -> None:
    package = _package(tmp_path, built=False)
    assert not native.compiled(package)
    assert native.stale(package) == []
