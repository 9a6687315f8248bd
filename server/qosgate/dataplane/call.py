"""The one description of a call, as every front end decodes it, and what the edge admits
it with.

Each front end (the relay's KServe calls and streams, qosgate.v1 on the relay, the OpenAI
HTTP API, the batch runner's items) only turns its wire format into a `Call`; the edge
(`qosgate.edge`) identifies the caller, resolves the class, fixes the deadline, admits,
routes and says what to stamp on the upstream request (`Admitted`), the same way for all
of them. The planes built on the data plane (generation, embedding) take the edge as a
`CallEdge`, so nothing here depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from qosgate.auth import ConnectionCredentials, Tenant
from qosgate.dataplane.plane import CallCost, CallScope
from qosgate.scheduler import Dispatch
from qosgate.transport.http2 import last_header
from qosgate.upstream.pool import Route

Header = tuple[bytes, bytes]


@dataclass(slots=True, init=False)
class Call:
    """One call as its front end decoded it."""

    rpc: str
    """The API and method (the `rpc` metric label): `ModelInfer`, `GenerateStream`,
    `openai.ChatCompletions`, `batch.Generate`..."""
    headers: Sequence[Header]
    """The request's headers as sent (names lower-case, values trimmed): the credentials,
    the model's session header and the W3C trace context are read from them."""
    caller: ConnectionCredentials
    """The caller's connection: its verified TLS certificate, the keys it was identified by."""
    model: str
    priority_class: str | None
    """The class the caller asked for (None: its tenant's default)."""
    timeout_s: float | None
    """Seconds the caller gives the call from when it was decoded (None: no deadline)."""
    tenant: Tenant | None
    """Who calls, once identified (a batch item's job's tenant from the start)."""
    deadline: float | None
    """`timeout_s` on the data plane's clock, fixed when the call's scope opens."""

    # Written out (init=False): the `__init__` that `dataclasses` generates is interpreted
    # even in a compiled module, and a Call is built for every call.
    def __init__(
        self,
        rpc: str,
        headers: Sequence[Header] = (),
        caller: ConnectionCredentials | None = None,
        *,
        model: str = "",
        priority_class: str | None = None,
        timeout_s: float | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        self.rpc = rpc
        self.headers = headers
        self.caller = ConnectionCredentials() if caller is None else caller
        self.model = model
        self.priority_class = priority_class or None
        self.timeout_s = timeout_s
        self.tenant = tenant
        self.deadline = None

    def header(self, name: bytes) -> bytes | None:
        """The last value of the header `name` (lower-case), as gRPC metadata merges them."""
        return last_header(self.headers, name)


@dataclass(slots=True, init=False)
class Admitted:
    """A call the edge let through: its dispatch slot, its upstream, and what to stamp on
    the request it sends there."""

    dispatch: Dispatch
    route: Route
    """Where the request goes, and where it may go once more (`Route.failover`)."""
    timeout_us: int | None
    """Triton's `timeout` for the request: what is left of the deadline (None: none)."""
    trace: Sequence[Header]
    """Headers for the upstream request: the W3C trace context of its upstream span."""

    def __init__(self, dispatch: Dispatch, route: Route, timeout_us: int | None, trace: Sequence[Header]) -> None:
        self.dispatch = dispatch
        self.route = route
        self.timeout_us = timeout_us
        self.trace = trace

    @property
    def priority_level(self) -> int:
        """Triton's `priority` for the request (1 = highest), from the call's class."""
        return self.dispatch.priority_level


class CallEdge(Protocol):
    """What the generation and embedding planes ask of the edge (`qosgate.edge.Edge`)."""

    def open(self, call: Call) -> CallScope:
        """The call's scope in the data plane; the caller is identified first."""
        ...

    async def admit(self, scope: CallScope, call: Call, cost: CallCost, *, prompt: str | None = None) -> Admitted:
        """Class, remaining deadline, quotas and a dispatch slot, then the upstream."""
        ...
