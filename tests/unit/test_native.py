"""The per-call modules run compiled (what `make native` builds is what the tests run), and
a compiled module built from other source than its own now is found, by content, so
importing qosgate refuses to run it."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import shutil
import types

import pytest

from qosgate import native

ROOT = pathlib.Path(__file__).resolve().parents[2]

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def test_every_listed_module_is_imported_compiled() -> None:
    assert native.compiled()
    for name in native.MODULES:
        module = importlib.import_module("qosgate." + name.removesuffix(".py").replace("/", "."))
        assert module.__file__ is not None and module.__file__.endswith(SUFFIX), module.__file__


def _package(tmp_path: pathlib.Path, *, built: bool) -> pathlib.Path:
    """A package of the listed modules; `built`: each with an extension module, recorded
    as built from the source it has."""
    for name in native.MODULES:
        source = tmp_path / name
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"# {name}\n")
        if built:
            source.with_name(source.stem + SUFFIX).write_bytes(b"")
    if built:
        record = "".join(f"{native.source_digest(tmp_path / n)}  {n}\n" for n in native.MODULES)
        (tmp_path / native.RECORD).write_text(record)
    return tmp_path


def test_a_module_edited_after_its_build_is_stale(tmp_path: pathlib.Path) -> None:
    package = _package(tmp_path, built=True)
    assert native.compiled(package) and native.stale(package) == []
    edited = native.MODULES[3]
    with (package / edited).open("a") as source:
        source.write("x = 1\n")
    assert native.stale(package) == [edited]


def test_file_times_do_not_matter_only_content(tmp_path: pathlib.Path) -> None:
    """An install (or a checkout) gives every file a new time: a source newer than its
    extension module, with the content it was built from, is not stale."""
    package = _package(tmp_path, built=True)
    for name in native.MODULES:
        os.utime(package / name, (3_000, 3_000))
        os.utime((package / name).with_name((package / name).stem + SUFFIX), (1_000, 1_000))
    installed = tmp_path.parent / "installed"
    shutil.copytree(package, installed)  # new times again, same content
    assert native.stale(package) == [] and native.stale(installed) == []


def test_extension_modules_without_a_record_are_stale(tmp_path: pathlib.Path) -> None:
    package = _package(tmp_path, built=True)
    (package / native.RECORD).unlink()
    assert native.stale(package) == list(native.MODULES)


def test_source_without_extension_modules_runs_interpreted_and_is_not_stale(
    tmp_path: pathlib.Path,
) -> None:
    package = _package(tmp_path, built=False)
    assert not native.compiled(package)
    assert native.stale(package) == []


def _build_script(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """scripts/build_native.py, pointed at a checkout under `tmp_path` with one module."""
    spec = importlib.util.spec_from_file_location("build_native", ROOT / "scripts" / "build_native.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    package = tmp_path / "server" / "qosgate"
    package.mkdir(parents=True)
    (package / "config.py").write_text("LIMIT: int = 1\n")
    (tmp_path / "pyproject.toml").write_text("[tool.mypy]\n")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "PACKAGE", package)
    return script


def test_the_build_cache_key_changes_with_any_source_of_the_package(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compiled module's C depends on the types of the modules it imports, compiled or
    # not: an edit anywhere in the package must miss the cache, a touch must not.
    script = _build_script(tmp_path, monkeypatch)
    package = tmp_path / "server" / "qosgate"
    first = script.inputs_digest()
    os.utime(package / "config.py", (0, 0))
    assert script.inputs_digest() == first
    (package / "config.py").write_text("LIMIT: float = 1.0\n")
    edited = script.inputs_digest()
    assert edited != first
    (package / "v1").mkdir()
    (package / "v1" / "common_pb2.pyi").write_text("class Usage: ...\n")
    stubbed = script.inputs_digest()
    assert stubbed not in (first, edited)
    (tmp_path / "pyproject.toml").write_text("[tool.mypy]\nstrict = true\n")
    assert script.inputs_digest() not in (first, edited, stubbed)
