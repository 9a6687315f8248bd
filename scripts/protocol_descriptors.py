"""Write a FileDescriptorSet of the protocols whose .proto files qosgate does not ship, for
`protoc --descriptor_set_in` to generate stubs from in any language (run by `make clients`).

- KServe v2 (`inference.GRPCInferenceService`): Triton's protocol. tritonclient ships it
  compiled (`grpc_service_pb2`, `model_config_pb2`) but no .proto file, and no .proto text
  is copied into this repository, so the descriptors come from those modules.
- google.rpc `Status` and `RetryInfo`: the gateway's refusals carry RetryInfo in the
  status details; taken from googleapis-common-protos' modules the same way.

Each file is written after the files it imports (google/protobuf ones included), so the
set is complete on its own.

Usage: python scripts/protocol_descriptors.py OUT
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterable
from types import ModuleType

from google.protobuf import descriptor, descriptor_pb2
from google.rpc import error_details_pb2, status_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

KSERVE = (model_config_pb2, service_pb2)
GOOGLE_RPC = (status_pb2, error_details_pb2)


def descriptor_set(modules: Iterable[ModuleType]) -> descriptor_pb2.FileDescriptorSet:
    """The files of `modules` and everything they import, each after its imports."""
    files = descriptor_pb2.FileDescriptorSet()
    written: set[str] = set()

    def add(file: descriptor.FileDescriptor) -> None:
        if file.name in written:
            return
        written.add(file.name)
        for dependency in file.dependencies:
            add(dependency)
        file.CopyToProto(files.file.add())

    for module in modules:
        add(module.DESCRIPTOR)
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: protocol_descriptors.py OUT", file=sys.stderr)
        return 2
    out = pathlib.Path(argv[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    files = descriptor_set((*KSERVE, *GOOGLE_RPC))
    out.write_bytes(files.SerializeToString())
    names = ", ".join(f.name for f in files.file)
    print(f"wrote {len(files.file)} file descriptors to {out}: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
