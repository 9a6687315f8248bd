"""The self-sizing dispatch window of a model set to `dispatch_window: auto`, and the caps
it sets on the classes inside it: pure, on the caller's `now`.

The window is what the model may have in flight at its engines; the rest waits in the
gateway, where classes and weights decide the order. Three bounds, each from its own fact:

- Throughput: the window. While the classes ask for more than it holds, it grows
  (doubling until the first shrink, then by an eighth; an LLM engine's window doubles
  only to LLM_SLOW_START until its seats are known) until the engine itself says it
  is saturated: requests waiting inside it for a second or more (vLLM's or TensorRT-LLM's
  waiting queue; for Triton's dynamic batcher its pending requests, past a batch being
  formed) or a nearly full KV cache. Then it shrinks by a fifth, or, for an LLM engine
  that says how many it runs, to that: its seats, which the window then does not pass
  (probing a little more after SEATS_PROBE_S at them without a queue). So the window is
  what the engine runs at once: what vLLM runs without queueing, what a batcher executes
  plus the batch it forms; the engine never waits for the gateway, and the seats a lower
  class's nested reservation leaves free are free in the engine too.
- Fair share: each class's cap. Fair share orders only what waits in the gateway. A
  tenant whose requests are all in flight cannot be given more, however far below its
  weight it is served: with closed-loop callers (each sends its next request when one
  returns), a window larger than their concurrency makes shares follow concurrency, not
  weights. So while two or more tenants of a class compete, the class's cap stops short
  of where a competing tenant's outstanding requests would no longer cover its fair part
  of it (the edge), its excess queued in the gateway. A tenant's fair part is its weight
  times what one unit of its service occupies at the engine (`occupancy`: how long its
  requests stay in flight per unit of their cost), so long generations and short ones
  get equal service, not equal slots. A tenant competes while its outstanding requests
  cover at least half of its fair part; one that sends less (an open loop below its
  share) is served all it asks, and the others' fair parts are of what it leaves. Each
  competing tenant is held to its part of the cap, so the answers of a batch, coming back
  together, are not all taken by the tenants queued deepest while the others' next
  requests are still on their way; and each part follows what the tenant really got,
  corrected a little each interval by its shortfall from its weight's share of the recent
  service.
- A class's latency objective (`scheduler.latency_objective`): the caps of the classes
  below it. While a class with an objective is active beside lower ones and its recent
  first-response latency is above objective x its unloaded baseline, the lower classes'
  cap shrinks in proportion (by at most half per interval); well within it, it grows back
  by an eighth, then lifts. The window itself keeps its size: the protected class may use
  all of it, and the engine is never held idle for a latency it already meets.

A class's latency samples in an interval are its dispatches' first-response latencies,
and the age of each dispatch still without a first response that is already older than
the objective allows (under a flood a first response can take longer than an interval).
A class is active while it has a dispatch in flight or reported a latency within
ACTIVE_S. Its baseline is the lowest median of an interval's samples seen, let drift up
very slowly so that one lucky reading, or a model that got slower for good, cannot pin it.

Everything moves at most once per INTERVAL_S. After IDLE_RESTART_S with nothing queued or
in flight the window starts over (the engine may have changed): from where it started, or
for an LLM engine from what it runs at once (its seats, or LLM_SLOW_START until they are
known). An LLM engine keeps each request for a whole generation: a burst that meets a
window doubling from its start waits a second or more for seats that are free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

INTERVAL_S = 0.5
# Saturated when the engine's KV cache is this full (new sequences would be preempted).
KV_CACHE_HIGH = 0.9
DECREASE = 0.8
GROWTH_DIVISOR = 8
LARGEST_LATENCY_DECREASE = 0.5
# Per decision a class's baseline may rise by this fraction towards what is measured.
BASELINE_DRIFT = 0.002
# A class counts as active while it has a dispatch in flight or reported a latency
# within this long; engine readings older than this are ignored (the scrape stopped).
ACTIVE_S = 5.0
ENGINE_STALE_S = 5.0
# Requests arriving together wait in the engine until its next step (a batcher: until a
# batch forms); only a waiting queue that persists this long is saturation.
WAITING_PERSIST_S = 1.0
# With nothing queued or in flight this long, the window starts over.
IDLE_RESTART_S = 5.0
# A window held at an LLM engine's seats, with no queue in the engine this long, tries a
# little more.
SEATS_PROBE_S = 5.0
# An LLM engine (one that says how many it runs) keeps a request for a whole generation:
# a doubling past its seats leaves up to a window of requests in its queue for that long,
# dispatched when no tenant's part was binding (fair share orders only what waits in the
# gateway). Until its seats are known, slow start doubles to here only, then grows by an
# eighth, so the first overshoot is an eighth, not a window; known seats it doubles to.
LLM_SLOW_START = 32
# A class's fair cap is this far below its edge (the cap at which a competing tenant
# would have nothing queued): a closed loop's turnaround leaves it a little queue.
FAIR_MARGIN = 0.95
# A tenant whose outstanding requests cover this fraction of its fair part of the class's
# share of the window competes, and keeps competing down to COMPETING_STAY of it (a closed
# loop's count dips while its answers travel; an open loop's falls as its latency does).
COMPETING = 0.3
COMPETING_STAY = 0.2
# Each competing tenant's part follows what it really got: a part is multiplied by a
# correction that moves by SHARE_GAIN of the tenant's relative shortfall (or excess) from
# its weight's share of the recent service, per interval (the service is summed over some
# twenty intervals: a full correction each would overshoot), within CORRECTION_RANGE; by
# less while that sum covers fewer than CORRECTION_DISPATCHES of its dispatches (a small
# part of an LLM engine, whose generations take seconds, just started).
# What occupancy cannot see (answers that come back together, callers' turnaround,
# rounding a small part to whole requests) it corrects.
SHARE_GAIN = 0.05
CORRECTION_RANGE = (0.2, 5.0)
CORRECTION_DISPATCHES = 20.0
# Outstanding requests are smoothed over intervals: a closed loop's count dips while its
# answers travel back to the caller.
DEMAND_SMOOTHING = 0.5
# Occupancy is the ratio of the seconds in flight of a tenant's requests that ended to their
# cost, each summed over intervals with this decay, and so is the service each tenant got:
# a horizon of about ten seconds, over which a generation of a few seconds ends often
# enough; a tenant that changes what it sends still shows. Counted per ended request, its
# noise is how much alike the requests are: a tenant with a few requests in flight, whose
# dispatches come a few a second, reads the same occupancy as one with thirty (counting
# request-seconds against cost charged at dispatch read theirs apart by a tenth and more,
# and their caps with it).
OCCUPANCY_DECAY = 0.95
SERVICE_DECAY = 0.95
# The lower classes' cap grows back only below this fraction of the allowed latency.
LATENCY_HYSTERESIS = 0.8
# Latency samples kept per class and interval (their median decides).
_KEEP = 64


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports about its own saturation (summed over its upstreams)."""

    waiting: float
    """Requests queued inside the engine, not yet running (a batcher: its pending ones)."""
    kv_cache_usage: float | None
    """Fraction of the KV cache in use (0..1); None if the engine does not say."""
    running: float | None = None
    """Requests the engine runs now (an LLM engine's batch); None if it does not say."""


@dataclass(frozen=True, slots=True)
class TenantDemand:
    """One tenant of a class as the core reports it."""

    name: str
    weight: float
    outstanding: int
    """Requests queued in the gateway plus those in flight."""
    ended_s: float
    """Of its requests that ended so far, the seconds each was in flight, summed."""
    ended_cost: float
    """Of those requests, their cost (as settled), summed."""
    charged: float
    """Cost charged to it at dispatch so far (an estimate, settled when a request ends):
    its service as fair share counts it, without waiting for long requests to end."""
    elsewhere: float = 0.0
    """Cost charged to it at the other gateways sharing Redis so far."""
    dispatched: int = 0
    """Requests dispatched to it here so far."""


@dataclass(frozen=True, slots=True)
class FairPart:
    """One tenant of a class as the fair cap weighs it."""

    name: str
    weight: float
    outstanding: float
    occupancy: float | None
    """Seconds in flight per unit of cost of its requests that ended recently; None: not
    known yet."""
    served: float = 0.0
    """Cost served per interval recently (over some ten seconds), here and elsewhere."""
    correction: float = 1.0
    """What its part is multiplied by, learnt from the service it really got."""


@dataclass(frozen=True, slots=True)
class FairEdge:
    """Where a class's cap stops being fair to the tenants that compete in it."""

    left_over: float
    """Outstanding requests of the tenants that do not compete: all served at once."""
    edge: float
    """The competing tenants' part of the cap at which the first of them would have all
    its outstanding requests in flight, none left queued."""
    competing: tuple[FairPart, ...]
    shares: Mapping[str, float]
    """Per competing tenant, its fraction of the competing tenants' part of the cap."""


@dataclass(frozen=True, slots=True)
class Pressure:
    """What holds a model's queued requests back, as the scheduler sees it at a decision."""

    limited: bool
    """Some class has requests queued while its share of the window is full."""
    idle: bool
    """Nothing queued or in flight."""
    tenants: Mapping[int, Sequence[TenantDemand]]
    """By class level, the tenants with requests outstanding."""
    share: Mapping[int, float]
    """By class level, the fraction of the window its nested reservation lets it fill."""


@dataclass(frozen=True, slots=True)
class FairCaps:
    """A class's fair-share cap on what it has in flight, and each competing tenant's
    part of it: its requests beyond that wait queued even where the class has room, so
    answers that come back together cannot all be taken by the tenants queued deepest
    while the others' next requests are still on their way."""

    total: int
    tenants: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class WindowDecision:
    """A model's window and the caps on its classes, by level (a level not named has
    none): `fair` on what a class and its competing tenants have in flight, `lower` on
    the nested limit of a class below a protected one (everything in flight counts)."""

    window: int
    fair: Mapping[int, FairCaps]
    lower: Mapping[int, int]


@dataclass(slots=True)
class _ClassLatency:
    objective: float | None
    last_at: float = -ACTIVE_S
    baseline_s: float | None = None
    samples: list[float] = field(default_factory=list)  # of the current interval
    recent_s: float | None = None  # their median, once the interval is over
    # Dispatches not ended yet: when each was dispatched while it waits for its first
    # response, None once it answered.
    in_flight: dict[object, float | None] = field(default_factory=dict)

    def active(self, now: float) -> bool:
        return bool(self.in_flight) or now - self.last_at <= ACTIVE_S

    def close_interval(self, now: float) -> None:
        # A dispatch without its first response yet has a latency of at least its age.
        # One already past what the class may take is a sample of that age: an engine so
        # loaded that no first response comes within an interval is not "no evidence".
        if self.baseline_s is not None and self.objective is not None:
            overdue = self.objective * self.baseline_s
            for dispatched_at in self.in_flight.values():
                if len(self.samples) >= _KEEP:
                    break
                if dispatched_at is not None and now - dispatched_at > overdue:
                    self.samples.append(now - dispatched_at)
        if not self.samples:
            self.recent_s = None
            return
        recent = self.recent_s = statistics.median(self.samples)
        self.samples.clear()
        if self.baseline_s is None or recent < self.baseline_s:
            self.baseline_s = recent
        else:
            self.baseline_s = min(recent, self.baseline_s * (1.0 + BASELINE_DRIFT))


def fair_edge(tenants: Sequence[FairPart], cap: float, competed: Collection[str] = ()) -> FairEdge | None:
    """Where the class's cap stops covering every competing tenant's fair part with its
    outstanding requests; None while fewer than two compete (nothing to be fair between).
    Who competes is judged at the class's share of the window, `cap`; those in
    `competed` (last time) by the lower bar."""
    known = [t.occupancy for t in tenants if t.occupancy]
    typical = statistics.median(known) if known else 1.0
    # Weighted occupancy: a tenant's fair part of the cap is in proportion to it.
    parts = {t.name: t.weight * (t.occupancy or typical) * t.correction for t in tenants}
    total = sum(parts.values())
    if total <= 0:
        return None
    competing = [
        t
        for t in tenants
        if t.outstanding >= (COMPETING_STAY if t.name in competed else COMPETING) * cap * parts[t.name] / total
    ]
    if len(competing) < 2:
        return None
    left_over = sum(t.outstanding for t in tenants if t not in competing)
    share = sum(parts[t.name] for t in competing)
    edge = min(t.outstanding * share / parts[t.name] for t in competing)
    return FairEdge(left_over, edge, tuple(competing), {t.name: parts[t.name] / share for t in competing})


class _TenantTrack:
    """A tenant's outstanding requests and occupancy, smoothed over intervals."""

    __slots__ = (
        "_charged", "_dispatched", "_ended", "_ended_cost", "_ended_cost_was", "_ended_was", "_span", "correction",
        "dispatches", "outstanding", "residual", "service",
    )

    def __init__(self, first: TenantDemand) -> None:
        self.outstanding = float(first.outstanding)
        self._ended_was, self._ended_cost_was = first.ended_s, first.ended_cost
        self._charged = first.charged + first.elsewhere
        self._dispatched = first.dispatched
        self._ended = self._ended_cost = self.service = self._span = self.dispatches = 0.0
        self.correction = 1.0
        # Of its part, the fraction of a request its whole-request caps have not given yet.
        self.residual = 0.0

    def update(self, now: TenantDemand) -> None:
        self.outstanding = DEMAND_SMOOTHING * self.outstanding + (1 - DEMAND_SMOOTHING) * now.outstanding
        charged = now.charged + now.elsewhere
        self._ended = OCCUPANCY_DECAY * self._ended + (now.ended_s - self._ended_was)
        self._ended_cost = OCCUPANCY_DECAY * self._ended_cost + (now.ended_cost - self._ended_cost_was)
        # A gateway gone takes its count with it: that is no negative service.
        self.service = SERVICE_DECAY * self.service + max(0.0, charged - self._charged)
        # How many intervals `service` sums, decayed alike: a tenant back after a pause
        # has its rate compared, not a sum over a shorter past.
        self._span = SERVICE_DECAY * self._span + 1.0
        self.dispatches = SERVICE_DECAY * self.dispatches + max(0, now.dispatched - self._dispatched)
        self._ended_was, self._ended_cost_was, self._charged = now.ended_s, now.ended_cost, charged
        self._dispatched = now.dispatched

    def part(self, tenant: TenantDemand) -> FairPart:
        occupancy = self._ended / self._ended_cost if self._ended_cost > 0 else None
        rate = self.service / self._span if self._span else 0.0
        return FairPart(tenant.name, tenant.weight, self.outstanding, occupancy, rate, self.correction)

    def start_over(self) -> None:
        """Forget the service it got and what that taught (see `_fair_cap`)."""
        self.service = self._span = self.dispatches = 0.0
        self.correction = 1.0

    def correct(self, shortfall: float) -> None:
        low, high = CORRECTION_RANGE
        # A share measured on a few dispatches is mostly which requests happened to end
        # (a tenant with a small part of a slow engine may see none end in an interval):
        # trusted in proportion to how many it sums, up to CORRECTION_DISPATCHES.
        gain = SHARE_GAIN * min(1.0, self.dispatches / CORRECTION_DISPATCHES)
        self.correction = min(high, max(low, self.correction * (1.0 + gain * shortfall)))

    def whole(self, part: float) -> int:
        """`part` requests as a whole number, the fractions carried over so that over time
        the tenant gets its part on average (at least one)."""
        cap = max(1, math.floor(part + self.residual))
        self.residual += part - cap
        return cap


@dataclass(slots=True)
class WindowController:
    """One model's `auto` window and class caps; `objectives`: by class level, its
    latency objective (a multiple of its unloaded first-response latency)."""

    minimum: int
    maximum: int
    window: int
    objectives: Mapping[int, float] = field(default_factory=dict)
    next_at: float = 0.0
    slow_start: bool = True
    engine: EngineLoad | None = None
    engine_at: float = 0.0
    waiting_since: float | None = None  # since when every reading showed a waiting queue
    idle_since: float | None = None
    # What an LLM engine runs at once, learnt when requests kept waiting in it; the
    # window does not grow past it (a request sent beyond it only waits in the engine,
    # where a higher class's request then waits behind it for a seat).
    seats: int | None = None
    seats_at: float = 0.0
    fair: dict[int, FairCaps] = field(default_factory=dict)
    lower: dict[int, int] = field(default_factory=dict)
    # The nested limit of the classes below a protected one; None: none.
    lower_cap: int | None = None
    _initial: int = 0
    _classes: dict[int, _ClassLatency] = field(default_factory=dict)
    _tenants: dict[tuple[int, str], _TenantTrack] = field(default_factory=dict)
    # Per class level, who competed at the last decision, and with what weight.
    _competed: dict[int, frozenset[tuple[str, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._initial = self.window

    def dispatched(self, level: int, key: object, now: float) -> None:
        """A request of class `level` (0 highest), known by `key`, was dispatched."""
        stats = self._class(level)
        stats.last_at = now
        stats.in_flight[key] = now

    def latency(self, level: int, seconds: float, now: float, key: object = None) -> None:
        """A dispatch of class `level` got its first response `seconds` after it was
        dispatched (`key`: as given to `dispatched`, if it was)."""
        stats = self._class(level)
        if key in stats.in_flight:
            stats.in_flight[key] = None
        stats.last_at = now
        if len(stats.samples) < _KEEP:
            stats.samples.append(seconds)

    def ended(self, level: int, key: object) -> None:
        """The dispatch `key` of class `level` ended, with or without a first response."""
        stats = self._classes.get(level)
        if stats is not None:
            stats.in_flight.pop(key, None)

    def _class(self, level: int) -> _ClassLatency:
        stats = self._classes.get(level)
        if stats is None:
            stats = self._classes[level] = _ClassLatency(self.objectives.get(level))
        return stats

    def engine_load(self, load: EngineLoad, now: float) -> None:
        self.engine, self.engine_at = load, now
        # A request or two waits in any engine between its arrival and the next step.
        if load.waiting < max(2.0, self.window / GROWTH_DIVISOR):
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = now
        elif load.running is not None and now - self.waiting_since >= WAITING_PERSIST_S:
            # Requests kept waiting while these ran: what the engine runs at once.
            self.seats, self.seats_at = max(1, int(load.running)), now

    def decide(self, now: float, pressure: Pressure) -> WindowDecision | None:
        """The new window and caps if they move now, else None. Call often: it acts once
        per interval."""
        if now < self.next_at:
            return None
        self.next_at = now + INTERVAL_S
        for stats in self._classes.values():
            stats.close_interval(now)
        before = (self.window, self.fair, self.lower)
        self._size_window(now, pressure)
        self._set_caps(now, pressure)
        if (self.window, self.fair, self.lower) == before:
            return None
        return WindowDecision(self.window, self.fair, self.lower)

    def _size_window(self, now: float, pressure: Pressure) -> None:
        if pressure.idle:
            if self.idle_since is None:
                self.idle_since = now
            elif now - self.idle_since >= IDLE_RESTART_S:
                self.window, self.slow_start = self._restart_window(), True
            return
        self.idle_since = None
        load = self.engine if now - self.engine_at <= ENGINE_STALE_S else None
        seats = self.seats
        if load is not None and (
            (self.waiting_since is not None and now - self.waiting_since >= WAITING_PERSIST_S)
            or (load.kv_cache_usage is not None and load.kv_cache_usage >= KV_CACHE_HIGH)
        ):
            shrunk = seats if seats is not None and self.window > seats else int(self.window * DECREASE)
            self.window = max(self.minimum, shrunk)
            self.slow_start = False
        elif pressure.limited and not (load is not None and self.waiting_since is not None):
            # (Not while the engine has a queue, however young: slow start doubles every
            # interval, and a second of waiting for saturation to show is a doubling too
            # many, a backlog in the engine that the classes above then wait behind.)
            doubling = self.slow_start and (
                load is None or load.running is None or (seats if seats is not None else LLM_SLOW_START) > self.window
            )
            step = self.window if doubling else max(1, self.window // GROWTH_DIVISOR)
            grown = min(self.maximum, self.window + step)
            if seats is not None and grown > seats:
                if self.window < seats:
                    grown = seats
                elif now - self.seats_at >= SEATS_PROBE_S:
                    # Full at its seats without a queue for a while: perhaps it runs more
                    # now (shorter prompts leave KV for more sequences). Ask it.
                    self.seats, self.seats_at = grown, now
                else:
                    grown = self.window
            self.window = grown

    def _restart_window(self) -> int:
        """Where the window starts over after an idle spell (see the module)."""
        engine = self.engine
        if engine is None or engine.running is None:
            return self._initial
        return min(self.maximum, max(self._initial, self.seats if self.seats is not None else LLM_SLOW_START))

    def _set_caps(self, now: float, pressure: Pressure) -> None:
        fair = {}
        for level, tenants in pressure.tenants.items():
            caps = self._fair_cap(level, tenants, pressure.share.get(level, 1.0))
            if caps is not None:
                fair[level] = caps
        self.fair = fair
        protected = self._protected(now)
        if protected is None:
            self.lower_cap = None
            self.lower = {}
            return
        level, stats = protected
        self._move_lower_cap(stats)
        lower_cap = self.lower_cap
        self.lower = {} if lower_cap is None else {lower: lower_cap for lower in pressure.share if lower > level}

    def _fair_cap(self, level: int, tenants: Sequence[TenantDemand], share: float) -> FairCaps | None:
        tracks = []
        for tenant in tenants:
            track = self._tenants.get((level, tenant.name))
            if track is None:
                track = self._tenants[(level, tenant.name)] = _TenantTrack(tenant)
            else:
                track.update(tenant)
            tracks.append((tenant, track))
        live = {(level, tenant.name) for tenant in tenants}
        for key in [k for k in self._tenants if k[0] == level and k not in live]:
            del self._tenants[key]
        cap = max(1.0, self.window * share)
        before = self._competed.get(level, frozenset())
        found = fair_edge([track.part(tenant) for tenant, track in tracks], cap, {name for name, _ in before})
        if found is None:
            self._competed.pop(level, None)
            return None
        competing = frozenset((t.name, t.weight) for t in found.competing)
        if competing != before:
            # Who competes changed, or their weights (a reload): the service each got
            # before was shared by other rules. Shares and what corrects them start over.
            self._competed[level] = competing
            for tenant, track in tracks:
                track.start_over()
            found = fair_edge([track.part(tenant) for tenant, track in tracks], cap, {name for name, _ in before}) or found
            return self._fair_caps(level, found)
        served = sum(t.served for t in found.competing)
        weights = sum(t.weight for t in found.competing)
        for t in found.competing:
            if served > 0:
                target = t.weight / weights
                self._tenants[(level, t.name)].correct((target - t.served / served) / target)
        return self._fair_caps(level, found)

    def _fair_caps(self, level: int, found: FairEdge) -> FairCaps:
        competing = FAIR_MARGIN * found.edge
        return FairCaps(
            max(1, int(found.left_over + competing)),
            {name: self._tenants[(level, name)].whole(competing * part) for name, part in found.shares.items()},
        )

    def _protected(self, now: float) -> tuple[int, _ClassLatency] | None:
        """The highest active class with a latency objective, while a lower one is active."""
        active = sorted(level for level, s in self._classes.items() if s.active(now))
        for level in active:
            stats = self._classes[level]
            if stats.objective is not None:
                return (level, stats) if active[-1] > level else None
        return None

    def _move_lower_cap(self, stats: _ClassLatency) -> None:
        recent, baseline, objective = stats.recent_s, stats.baseline_s, stats.objective
        if recent is None or baseline is None or objective is None:
            return  # no evidence from the last interval: hold
        allowed = objective * baseline
        current = self.lower_cap if self.lower_cap is not None else self.window
        if recent > allowed:
            factor = max(LARGEST_LATENCY_DECREASE, allowed / recent)
            self.lower_cap = max(1, min(current - 1, int(current * factor)))
        elif self.lower_cap is not None and recent < LATENCY_HYSTERESIS * allowed:
            grown = current + max(1, current // GROWTH_DIVISOR)
            self.lower_cap = None if grown >= self.window else grown
