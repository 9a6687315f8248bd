"""Where the external load tools live once `make tools` installed them."""

from __future__ import annotations

import pathlib

from qosgate import paths


class ToolMissing(RuntimeError):
    """A load tool is not installed; the message names the command that installs it."""


def perf_analyzer() -> pathlib.Path:
    """The perf_analyzer shim (sets its library path), installed by `make tools`."""
    shim = paths.cache_dir() / "tools" / "perf_analyzer"
    if not shim.exists():
        raise ToolMissing(f"{shim} is missing: run `make tools`")
    return shim
