"""qosgate: a multi-tenant gRPC front door for NVIDIA Triton Inference Server."""

from qosgate import native

__version__ = "0.1.0"

if _stale := native.stale():
    raise ImportError(
        f"qosgate's compiled modules were built from other source than theirs now ({', '.join(_stale)}): "
        "run `make native` to compile them again"
    )
