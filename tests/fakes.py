"""Fakes for unit tests of pure logic (never used by integration tests)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from qosgate.auth import Tenant
from qosgate.config import LimitsConfig


class FakeClock:
    """A Clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self._now += seconds


class FakeWall:
    """Wall time (Unix seconds) as the ledgers and stores take it (`wall_time=`): a
    callable that moves only when a test sets `now`. The one wall-clock fake."""

    def __init__(self, now: float = 1_767_225_600.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def until(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Poll `condition` (plain or async) until it holds; fail after `timeout_s`. The
    deadline only stops a hung test: nothing is asserted about how fast it holds."""
    async with asyncio.timeout(timeout_s):
        while True:
            held = condition()
            if inspect.isawaitable(held):
                held = await held
            if held:
                return
            await asyncio.sleep(0.01)


def make_tenant(name: str = "acme", **fields: Any) -> Tenant:
    """A Tenant for unit tests: standard class, every model, no limits unless overridden.

    `limits` may be given as a dict of LimitsConfig fields.
    """
    limits = fields.pop("limits", {})
    values: dict[str, Any] = {
        "weight": 1.0,
        "default_class": "standard",
        "max_class": "critical",
        "models": ("*",),
        "admin": False,
        "limits": limits if isinstance(limits, LimitsConfig) else LimitsConfig(**limits),
    }
    values.update(fields)
    return Tenant(name=name, **values)


def recording_tracing() -> tuple[Any, Any]:
    """A Tracing whose spans land in memory: (tracing, exporter); read
    `exporter.get_finished_spans()`."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from qosgate.dataplane.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def make_edge(config: Any, plane: Any) -> Any:
    """The real edge over `plane`, for unit tests of the planes (whose engines are fakes):
    the config's upstreams are marked live by hand and never connected."""
    from qosgate.edge import Edge
    from qosgate.upstream import UpstreamPool

    pool = UpstreamPool(config.upstreams, routing=lambda model: config.model_policy(model).routing)
    for upstream in pool.upstreams:
        upstream.live = True
    return Edge(config=config, plane=plane, upstreams=pool)


def make_dataplane(
    config: Any, clock: Any, *, usage: Any = None, wall: float = 1_767_229_200.0, tracing: Any = None
) -> Any:
    """A DataPlane over in-memory parts (quota store, usage ledger, metrics registry,
    `tracing` or none) for unit tests of the planes; `plane.metrics.registry` shows what
    it counted, and `recording_tracing()`'s exporter what it traced."""
    from qosgate.auth import TenantDirectory
    from qosgate.dataplane.plane import DataPlane
    from qosgate.metrics import GatewayMetrics
    from qosgate.quota import Admission, InMemoryQuotaStore
    from qosgate.quota.tokens import DailyTokenBudget
    from qosgate.scheduler import Scheduler
    from qosgate.usage import UsageLedger, UsageMeter

    if usage is None:
        usage = UsageMeter(UsageLedger(":memory:", wall_time=lambda: wall), wall_time=lambda: wall)
    plane = DataPlane(
        directory=TenantDirectory(config),
        admission=Admission(InMemoryQuotaStore(), clock),
        budget=DailyTokenBudget(wall_time=lambda: wall, totals=usage),
        scheduler=Scheduler(config, clock),
        usage=usage,
        metrics=GatewayMetrics(known_models=config.models),
        tracing=tracing or recording_tracing()[0],
        clock=clock,
        output_token_weight=config.scheduler.output_token_weight,
    )
    return plane
