"""Generate the qosgate.v1 Python modules from protos/ (run by `make protos`).

The proto package `qosgate.v1` maps onto the Python subpackage `qosgate.v1`, so the
generated files land in server/qosgate/v1/ and import each other without rewriting.
They are build output: git ignores them.
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


def main() -> int:
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not sources:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *sources,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    package = OUT / "qosgate" / "v1"
    (package / "__init__.py").write_text('"""Generated from protos/qosgate/v1 at setup."""\n')
    STAMP.touch()
    print(f"generated {len(sources)} proto file(s) into {package.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
