"""The one edge every API's calls go through, whichever front end decoded them.

    tenant   = edge.identify(call)        key headers, or the TLS client certificate
    scope    = edge.open(call)            the data plane's scope; the deadline fixed now
    admitted = await edge.admit(scope, call, cost, prompt=...)
               class → remaining deadline → quotas → dispatch slot (CallScope.admit)
               → the route: the model's routing policy over the live upstreams, and its
                 one failover (upstream.pool.Route)
               → what to stamp on the upstream request: Triton's priority and timeout,
                 the upstream span's trace context (dataplane.call.Admitted)

A front end (the relay's KServe calls and streams and qosgate.v1 calls, the OpenAI API,
the gRPC admin and batch services, the batch runner's items) only decodes its wire into a
`Call`; everything above is decided here, once, the same way for all of them, and a
refusal is counted the same way whichever front end it came through (before a scope
exists by `identify`, after by the scope's close).
"""

from __future__ import annotations

from collections.abc import Mapping

from qosgate.auth import API_KEY, AUTHORIZATION, Tenant
from qosgate.config import CostUnit, GatewayConfig, RoutingConfig
from qosgate.dataplane.call import Admitted, Call
from qosgate.dataplane.plane import CallCost, CallScope, DataPlane
from qosgate.dataplane.tracing import TRACEPARENT, TRACESTATE
from qosgate.error_table import row_of
from qosgate.errors import GatewayError, InvalidArgument
from qosgate.kserve.wire import MAX_STRING_BYTES
from qosgate.upstream.pool import UpstreamPool
from qosgate.upstream.routing import routing_key

# The headers a call may present its API key in: read here, never sent on to Triton (a
# tenant's key is the gateway's business, and an upstream link may be plaintext).
CREDENTIALS = frozenset(name.encode() for name in (AUTHORIZATION, API_KEY))
_TRACE = frozenset(name.encode() for name in (TRACEPARENT, TRACESTATE))


class Edge:
    """Identify, open, admit and route calls of every API (see the module)."""

    def __init__(self, *, config: GatewayConfig, plane: DataPlane, upstreams: UpstreamPool) -> None:
        self.plane = plane
        self.upstreams = upstreams
        self.models = ModelFacts(config)

    def admits_in_process(self, tenant: Tenant) -> bool:
        """Whether admission decides `tenant`'s calls without a network round trip (quotas
        in this process, or none to count), so a call may be decided in its front end's
        callback, without a task."""
        return self.plane.admission.in_process(tenant.limits)

    def identify(self, call: Call) -> Tenant:
        """Who makes `call` (its `tenant` once known): the tenant of its one key
        (`authorization: Bearer <key>` or `x-api-key`), or of its verified client
        certificate. A refusal (Unauthenticated) is counted here and raised."""
        tenant = call.tenant
        if tenant is None:
            credentials = tuple(pair for pair in call.headers if pair[0] in CREDENTIALS)
            try:
                tenant = self.plane.directory.identify_on(call.caller, credentials)
            except GatewayError as e:  # no tenant, so no scope: counted here
                self.refused(call, e)
                raise
            call.tenant = tenant
        return tenant

    def refused(self, call: Call, error: GatewayError) -> None:
        """Count a refusal of `call` made without a scope (its identification; a call of
        no model, such as an admin RPC), as a scope's close counts one."""
        row = row_of(error)
        tenant = call.tenant.name if call.tenant is not None else ""
        metrics = self.plane.metrics
        metrics.rejected(row.reason, tenant, "")
        metrics.request_done(call.rpc, call.model, tenant, "", row.code)

    def open(self, call: Call) -> CallScope:
        """The call's scope in the data plane (its caller identified first); the deadline
        is fixed now, from the time the caller gave it. Close it however the call ends."""
        tenant = self.identify(call)
        if call.timeout_s is not None and call.deadline is None:
            call.deadline = self.plane.clock.now() + call.timeout_s
        return self.plane.open(call.rpc, tenant, call.model, _trace_context(call))

    async def admit(self, scope: CallScope, call: Call, cost: CallCost, *, prompt: str | None = None) -> Admitted:
        """Authorize the model and class, admit (quotas), wait for a dispatch slot within
        the deadline, and route: a refusal raises its GatewayError (the scope counts it
        when closed). `prompt`: what a generation's prefix affinity keys on."""
        model = call.model
        if len(model) > MAX_STRING_BYTES:  # Triton would quote it back in a header too long to read
            raise InvalidArgument(f"a model name is at most {MAX_STRING_BYTES} characters")
        dispatch = await scope.admit(cost, priority_class=call.priority_class, deadline=call.deadline)
        facts = self.models
        routing = facts.routing(model)
        key = None
        if routing.policy == "prefix_affinity":
            header = facts.session_header(model)
            value = call.header(header) if header is not None else None
            session = value.decode("latin-1") if value else None
            key = routing_key(routing, prompt, session)
        route = self.upstreams.route(model, key=key, observer=scope)
        trace = [(name.encode(), value.encode()) for name, value in scope.upstream_headers()]
        return Admitted(dispatch, route, scope.timeout_us, trace)


def _trace_context(call: Call) -> Mapping[str, str] | None:
    """The caller's W3C trace context headers, if it sent any."""
    found: dict[str, str] | None = None
    for name, value in call.headers:
        if name in _TRACE:
            if found is None:
                found = {}
            found[name.decode("latin-1")] = value.decode("latin-1")
    return found


class ModelFacts:
    """What the edge reads of a model's policy on every call, from plain dicts: the
    config's own lookups (pydantic models, a routing callable) run interpreted and cost
    more than the rest of a call's routing."""

    __slots__ = (
        "_units",
        "_default_unit",
        "_session_headers",
        "_default_session_header",
        "_routing",
        "_default_routing",
        "_engine_counts",
        "_default_engine_counts",
    )

    def __init__(self, config: GatewayConfig) -> None:
        models, default = config.models, config.default_model_policy
        self._units = {name: policy.cost_unit for name, policy in models.items()}
        self._default_unit: CostUnit = default.cost_unit
        self._session_headers = {name: _header_name(policy.routing.session_header) for name, policy in models.items()}
        self._default_session_header = _header_name(default.routing.session_header)
        self._routing = {name: policy.routing for name, policy in models.items()}
        self._default_routing = default.routing
        self._engine_counts = {name: policy.kserve_token_counts for name, policy in models.items()}
        self._default_engine_counts = default.kserve_token_counts

    def cost_unit(self, model: str) -> CostUnit:
        """The unit `model`'s calls are charged in (ModelPolicy.cost_unit)."""
        return self._units.get(model, self._default_unit)

    def session_header(self, model: str) -> bytes | None:
        """The header (lower-case) `model`'s routing reads a session id from, if any."""
        return self._session_headers.get(model, self._default_session_header)

    def routing(self, model: str) -> RoutingConfig:
        """`model`'s routing policy (ModelPolicy.routing)."""
        return self._routing.get(model, self._default_routing)

    def engine_token_counts(self, model: str) -> bool:
        """Whether `model`'s KServe generation requests are charged the engine's own token
        counts (ModelPolicy.kserve_token_counts)."""
        return self._engine_counts.get(model, self._default_engine_counts)


def _header_name(name: str | None) -> bytes | None:
    return None if name is None else name.encode("latin-1")  # lower case (the config says so)
