"""Temporary model-repository variants: a model from model_repository/ with its config edited."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from qosgate import paths

ModelConfig = model_config_pb2.ModelConfig


def write_variant(repo: pathlib.Path, source: str, name: str, edit: Callable[[ModelConfig], None]) -> None:
    """Copy model `source` into `repo` as `name`, with `edit` applied to its parsed config."""
    origin = paths.model_repository() / source
    shutil.copytree(origin, repo / name, ignore=shutil.ignore_patterns("__pycache__", "config.pbtxt"))
    config = text_format.Parse((origin / "config.pbtxt").read_text(), ModelConfig())
    config.name = name
    edit(config)
    (repo / name / "config.pbtxt").write_text(text_format.MessageToString(config))
