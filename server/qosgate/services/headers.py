"""The request metadata the gateway reads by key (the class, Triton's error header).

Credentials are not read here: `TenantDirectory.identify` takes the metadata as sent,
repeated keys included, because a repeated credential header must be refused, not
collapsed to one of its values as a dict would.
"""

from __future__ import annotations

import grpc


def text_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata by key (lower-case, as gRPC delivers them; a repeated key
    keeps its last value); binary (`-bin`) entries are left out: none of the headers read
    by key is binary."""
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
