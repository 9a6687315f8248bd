"""Generate the qosgate.v1 Python modules from protos/ (`make protos`, and the wheel's
build step in setup.py).

The proto package `qosgate.v1` maps onto the Python subpackage `qosgate.v1`, so the
generated files land in <out>/qosgate/v1/ and import each other without rewriting: in
server/ for a checkout, in the build directory for a wheel. They are build output: git
ignores them.
"""

from __future__ import annotations

import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "server"
STAMP = OUT / "qosgate" / "v1" / ".built"


def generate(out: pathlib.Path) -> int:
    """Write the qosgate.v1 modules of every file under protos/ into `out`/qosgate/v1."""
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not sources:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    package = out / "qosgate" / "v1"
    (package / "__init__.py").write_text('"""Generated from protos/qosgate/v1 at build."""\n')
    print(f"generated {len(sources)} proto file(s) into {package}")
    return 0


def main() -> int:
    if generate(OUT) != 0:
        return 1
    STAMP.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
