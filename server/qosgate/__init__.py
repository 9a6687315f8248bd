"""qosgate: a multi-tenant gRPC front door for NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
