"""The Triton endpoints behind the gateway: channels, health, and which one gets a call."""

from qosgate.upstream.pool import Upstream, UpstreamPool

__all__ = ["Upstream", "UpstreamPool"]
