"""Fair share over every gateway that shares a Redis: what each one publishes about its
queues, and what it makes of the others' reports. Pure; the exchange itself (every
EXCHANGE_INTERVAL_S, off every call's path) is the quota store's (`quota.redis_store`).

Each gateway reports, per model, class and tenant, the service it has given the tenant
so far (the cost it charged, as its fair-share tags count it) and what the tenant has
queued and outstanding there, and per tenant the tokens it holds in flight. From the
others' reports a gateway takes three things:

- Remote service. A tenant served at other gateways is charged for it here too: its tags
  move by what it got elsewhere since the last report, as if served here. So a tenant
  that sends to every gateway and one that sends to one get the same share: the
  gateway that sees both gives the second what the first gets elsewhere.
- Holds. Ordering cannot help a tenant whose calls wait at another gateway, nor one whose
  calls here are all in flight already: when a competing tenant is served below its
  weight over the cluster (its recent service per unit of weight more than
  HOLD_TOLERANCE below another's), this gateway limits what the tenants ahead of it may
  have in flight here, in proportion to how far ahead they are. The engine's capacity
  they leave goes to the tenant's calls queued here, or is what the other gateway's
  window grows into (its window is full and the engine no longer saturated). Whether it
  is queued here says nothing: under a closed loop that changes from one report to the
  next.
- Tokens in flight, for `max_inflight_tokens` over the cluster.

With no report from anyone else (alone, or Redis unreachable) all three are empty, and
the gateway's own fair share is all there is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from qosgate.scheduler.window import FairPart, fair_edge

log = logging.getLogger(__name__)

# How often each gateway publishes its report and reads the others'.
EXCHANGE_INTERVAL_S = 0.1
# A gateway that has not reported for this long is gone: its report is dropped.
REPORT_TTL_S = 1.0
# A tenant's rate of service is summed over reports with this decay per second.
RATE_DECAY_PER_S = 0.5
# Held back while its service per unit of weight is more than this much above a starved
# competitor's: its in-flight limit moves half way (in ratio) to where it would match,
# down while it is above and back up the same way once it is as much below, so that it
# sits on the competitor's rate on average, not at one edge of the band; lifted by
# LIMIT_GROWTH a step once no competitor is starved. Limits move at most every
# LIMIT_INTERVAL_S: the rates they act on take about that long to show a change.
HOLD_TOLERANCE = 0.02
LIMIT_GROWTH = 1.25
LIMIT_INTERVAL_S = 1.0
# Rates need this much history before they may hold anything back.
RATE_WARMUP_S = 1.0


@dataclass(frozen=True, slots=True)
class TenantShare:
    """One tenant of one model and class at one gateway."""

    model: str
    level: int
    tenant: str
    weight: float
    charged: float
    """Cost charged to the tenant at this gateway so far."""
    outstanding: int
    queued: int


@dataclass(frozen=True, slots=True)
class GatewayReport:
    """What one gateway publishes."""

    tenants: Sequence[TenantShare]
    windows: Mapping[str, int]
    """Per model, its dispatch window."""
    tokens: Mapping[str, int]
    """Per tenant, the tokens it holds in flight (`max_inflight_tokens`)."""

    def encode(self) -> bytes:
        return json.dumps(
            {
                "t": [[s.model, s.level, s.tenant, s.weight, s.charged, s.outstanding, s.queued] for s in self.tenants],
                "w": self.windows,
                "k": self.tokens,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> GatewayReport:
        """A report as another gateway published it; ValueError if it is not one."""
        try:
            doc = json.loads(data)
            return cls(
                tenants=[
                    TenantShare(str(m), int(lv), str(t), float(w), float(c), int(o), int(q))
                    for m, lv, t, w, c, o, q in doc["t"]
                ],
                windows={str(k): int(v) for k, v in doc["w"].items()},
                tokens={str(k): int(v) for k, v in doc["k"].items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a gateway report: {e}") from None


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What this gateway takes from the others' reports."""

    remote_charged: Mapping[tuple[str, int, str], float]
    """Per (model, level, tenant), the cost the other gateways have charged it so far."""
    limits: Mapping[tuple[str, int, str], int]
    """Per (model, level, tenant) held back here for a starved competitor elsewhere, what
    it may have in flight at this gateway."""
    remote_tokens: Mapping[str, int]
    """Per tenant, the tokens it holds in flight at the other gateways."""


ALONE = ClusterView({}, {}, {})


@dataclass(slots=True)
class _Rate:
    charged: float
    at: float
    since: float
    rate: float = 0.0


@dataclass(slots=True)
class ClusterShare:
    """Turns the reports of the other gateways into a `ClusterView`, keeping the
    cluster-wide service rates between calls."""

    share: Mapping[int, float]
    """Per class level, the fraction of a window its nested reservation lets it fill."""
    _rates: dict[tuple[str, int, str], _Rate] = field(default_factory=dict)
    _caps: dict[tuple[str, int, str], float] = field(default_factory=dict)
    _limited_at: float = float("-inf")

    def view(self, now: float, local: GatewayReport, others: Iterable[GatewayReport]) -> ClusterView:
        others = list(others)
        if not others:
            self._rates.clear()
            self._caps.clear()
            return ALONE
        remote: dict[tuple[str, int, str], float] = {}
        merged: dict[tuple[str, int, str], list[float]] = {}  # weight, charged, outstanding, queued
        windows: dict[str, int] = dict(local.windows)
        tokens: dict[str, int] = {}
        for report in others:
            for s in report.tenants:
                key = (s.model, s.level, s.tenant)
                remote[key] = remote.get(key, 0.0) + s.charged
                self._add(merged, s)
            for model, window in report.windows.items():
                windows[model] = windows.get(model, 0) + window
            for tenant, count in report.tokens.items():
                tokens[tenant] = tokens.get(tenant, 0) + count
        for s in local.tenants:
            self._add(merged, s)
        rates = self._update_rates(now, merged)
        return ClusterView(remote, self._limits(now, merged, rates, windows, local), tokens)

    @staticmethod
    def _add(merged: dict[tuple[str, int, str], list[float]], s: TenantShare) -> None:
        entry = merged.setdefault((s.model, s.level, s.tenant), [s.weight, 0.0, 0.0, 0.0])
        entry[1] += s.charged
        entry[2] += s.outstanding
        entry[3] += s.queued

    def _update_rates(self, now: float, merged: Mapping[tuple[str, int, str], list[float]]) -> dict[tuple[str, int, str], float]:
        rates = {}
        for key, (_, charged, _, _) in merged.items():
            seen = self._rates.get(key)
            if seen is None:
                self._rates[key] = _Rate(charged, now, now)
                continue
            elapsed = now - seen.at
            if elapsed > 0:
                # A gateway gone takes its count with it: start again from what is left.
                gained = max(0.0, charged - seen.charged)
                keep = RATE_DECAY_PER_S**elapsed
                seen.rate = keep * seen.rate + (1 - keep) * gained / elapsed
                seen.charged, seen.at = charged, now
            if now - seen.since >= RATE_WARMUP_S:
                rates[key] = seen.rate
        for key in [k for k in self._rates if k not in merged]:
            del self._rates[key]
        return rates

    def _limits(
        self,
        now: float,
        merged: Mapping[tuple[str, int, str], list[float]],
        rates: Mapping[tuple[str, int, str], float],
        windows: Mapping[str, int],
        local: GatewayReport,
    ) -> dict[tuple[str, int, str], int]:
        in_flight = {(s.model, s.level, s.tenant): s.outstanding - s.queued for s in local.tenants if s.outstanding}
        outstanding = {(s.model, s.level, s.tenant): s.outstanding for s in local.tenants}
        ratios: dict[tuple[str, int, str], float] = {}
        for (model, level), parts in self._classes(merged).items():
            found = fair_edge(parts, max(1.0, windows.get(model, 0) * self.share.get(level, 1.0)))
            if found is None:
                continue
            normalized = {}
            for part in found.competing:
                rate = rates.get((model, level, part.name))
                if rate is None:
                    break
                normalized[part.name] = rate / part.weight
            else:
                # Each tenant here against the least served of the others. Only a competitor
                # served at all counts: one served nothing is stuck for some other reason,
                # which holding the engine idle would not mend.
                for name, rate in normalized.items():
                    others = [r for n, r in normalized.items() if n != name and r > 0]
                    if others and (model, level, name) in in_flight:
                        ratios[(model, level, name)] = rate / min(others)
        due = now - self._limited_at >= LIMIT_INTERVAL_S
        if due:
            self._limited_at = now
        limits = {}
        for key in set(self._caps) | set(ratios):
            ratio = ratios.get(key, 0.0)
            cap = self._caps.get(key)
            if ratio > 1 + HOLD_TOLERANCE:
                if cap is None or due:
                    # Rate follows requests in flight: move half way (in ratio) to the cap
                    # that would bring it down to the starved competitor's.
                    cap = max(1.0, (cap if cap is not None else max(1, in_flight.get(key, 1))) / ratio**0.5)
            elif cap is not None and due and key not in ratios:
                cap *= LIMIT_GROWTH  # no competitor starved any more: let go
            elif cap is not None and due and ratio < 1 - HOLD_TOLERANCE:
                # Half way back up, as it came down: a step of another size would leave
                # the tenant on one side of its share on average.
                cap /= max(ratio, 1 / LIMIT_GROWTH**2) ** 0.5
            # A limit above all the tenant has here holds nothing back any more.
            if cap is None or cap > outstanding.get(key, 0):
                self._caps.pop(key, None)
                continue
            self._caps[key] = cap
            limits[key] = round(cap)  # not floored: that would hold it below its cap on average
        return limits

    @staticmethod
    def _classes(merged: Mapping[tuple[str, int, str], list[float]]) -> dict[tuple[str, int], list[FairPart]]:
        by_class: dict[tuple[str, int], list[FairPart]] = {}
        for (model, level, tenant), (weight, _, outstanding, _) in merged.items():
            if outstanding:
                by_class.setdefault((model, level), []).append(FairPart(tenant, weight, outstanding, None))
        return by_class


class ReportExchange(Protocol):
    """Where gateways publish their reports and read each other's (the Redis quota store)."""

    async def exchange_reports(self, report: bytes, ttl_s: float) -> list[bytes] | None:
        """Publish `report`, return the other live gateways' (None: cannot reach them)."""
        ...


class ClusterExchange:
    """Every EXCHANGE_INTERVAL_S: this gateway's report out, the others' in (`publish`
    builds the one, `receive` takes the others; an empty list while none can be read)."""

    def __init__(
        self,
        exchange: ReportExchange,
        publish: Callable[[], GatewayReport],
        receive: Callable[[Sequence[GatewayReport]], None],
    ) -> None:
        self._exchange = exchange
        self._publish = publish
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self._unreadable = False
        self._paused = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fair-share exchange")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.exchange_once()
            await asyncio.sleep(EXCHANGE_INTERVAL_S)

    async def exchange_once(self) -> None:
        replies = await self._exchange.exchange_reports(self._publish().encode(), REPORT_TTL_S)
        if (replies is None) != self._paused:
            # Once per outage, in the words of what it means for fair share.
            self._paused = replies is None
            if self._paused:
                log.warning("fair share across gateways paused: Redis does not answer; "
                            "serving by this gateway's own until it does")
            else:
                log.warning("fair share across gateways resumed")
        reports = []
        for reply in replies or ():
            try:
                reports.append(GatewayReport.decode(reply))
            except ValueError as e:
                # Logged once: a gateway of another version would say so 10 times a second.
                if not self._unreadable:
                    self._unreadable = True
                    log.warning("ignoring a fair-share report this gateway cannot read: %s", e)
        self._receive(reports)
