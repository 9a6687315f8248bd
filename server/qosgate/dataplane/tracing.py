"""OpenTelemetry spans of the data plane, and W3C trace context in and out.

Each call gets a span (`qosgate <rpc>`, attributes tenant, model, class, code) whose
parent is the caller's `traceparent` when it sent one; its children time the queue wait,
each upstream attempt and the time to its first response. The upstream attempt's context
goes to Triton as `traceparent`, so a Triton with tracing on continues the same trace.

Tracing is off unless `tracing.otlp_endpoint` is set: the API's no-op tracer then makes
no spans, and a caller's `traceparent` is still passed on to Triton unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from qosgate.config import TracingConfig

_PROPAGATOR = TraceContextTextMapPropagator()
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"  # the W3C trace context headers


class Tracing:
    """Makes the data plane's spans with `provider` (None: the API's no-op tracer)."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider
        self._tracer = (provider or trace.NoOpTracerProvider()).get_tracer("qosgate")

    @property
    def enabled(self) -> bool:
        """Whether spans are made (an exporter is configured)."""
        return self._provider is not None

    @classmethod
    def from_config(cls, config: TracingConfig) -> Tracing:
        """An OTLP/gRPC exporting provider when `otlp_endpoint` is set, else no-op."""
        if config.otlp_endpoint is None:
            return cls()
        # Imported only when used: the exporter pulls in its own gRPC stubs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=config.insecure))
        )
        return cls(provider)

    def call_span(self, rpc: str, tenant: str, model: str, headers: Mapping[str, str] | None) -> Span:
        """The span of one call, child of the caller's `traceparent` if it sent one."""
        parent = _PROPAGATOR.extract(headers) if headers and TRACEPARENT in headers else None
        if self._provider is None:
            # Tracing is off: no span, but the caller's own context goes on to Triton.
            return trace.INVALID_SPAN if parent is None else trace.get_current_span(parent)
        return self._tracer.start_span(
            f"qosgate {rpc}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"qosgate.rpc": rpc, "qosgate.tenant": tenant, "qosgate.model": model},
        )

    def child(self, parent: Span, name: str, attributes: Mapping[str, str] | None = None) -> Span:
        """A span under `parent` (its own start now; end it)."""
        if self._provider is None:
            return trace.INVALID_SPAN
        return self._tracer.start_span(name, context=trace.set_span_in_context(parent), attributes=attributes)

    def headers(self, span: Span, fallback: Span) -> Sequence[tuple[str, str]]:
        """The `traceparent` (and `tracestate`) of `span`, else of `fallback`, to send on."""
        chosen = span if span.get_span_context().is_valid else fallback
        if not chosen.get_span_context().is_valid:
            return ()
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(chosen))
        return tuple(carrier.items())

    def end_call(self, span: Span, code: str, error: BaseException | None) -> None:
        """End a call's span with its status code (the error table's name)."""
        if span.is_recording():
            span.set_attribute("qosgate.code", code)
            if code != "OK":
                span.set_status(Status(StatusCode.ERROR, type(error).__name__ if error else code))
        span.end()

    def shutdown(self) -> None:
        """Flush and stop the exporter (at gateway stop)."""
        if isinstance(self._provider, TracerProvider):
            self._provider.shutdown()
