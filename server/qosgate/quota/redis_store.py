"""Quota state in Redis, shared by every gateway process that points at the same server.

Each check-and-charge is one Lua script run with EVALSHA, so it is atomic across gateways:
two replicas can never both take the last token or the last concurrency slot.

Time is Redis server time (`TIME` inside the scripts), not the caller's clock. The buckets
live on one timeline shared by every gateway: callers' monotonic clocks have unrelated
origins in different processes, and their wall clocks drift apart between hosts, so
either would let a bucket refill too fast or not at all when replicas take turns. Redis
time is the one reading all replicas agree on. The `now` the `QuotaStore` protocol passes
in is therefore unused here.

Keys of one tenant share a hash tag (`{tenant}`): each script touches one cluster slot,
ready for Redis Cluster (this store connects to one server).
- `<prefix>:{t}:rps:<rate>:<burst>`  hash: request bucket (level, updated)
- `<prefix>:{t}:tpm:<per minute>`    hash: token bucket (level, updated)
- `<prefix>:{t}:slots`               sorted set: concurrency slot id → lease expiry
- `<prefix>:{t}:day:<YYYY-MM-DD>`    hash: the UTC day's usage (requests, prompt and
  completion tokens), what `daily_token_budget` counts; kept for 3 days
- `<prefix>:{share}:reports`, `<prefix>:{share}:beats`  hash and sorted set: each live
  gateway's fair-share report (scheduler/cluster.py) and when it last wrote one
Bucket keys are named after their limits: after a config reload, gateways still on the old
config and those on the new one each use their own bucket instead of resetting a shared one
back and forth. A full bucket and a missing key mean the same, so bucket keys expire once
they would have refilled.

Concurrency slots carry a lease that this store renews while their requests run: the slots
of a gateway that dies without releasing them expire after at most `lease_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from qosgate.clock import Clock
from qosgate.config import LimitsConfig, QuotaStoreConfig
from qosgate.errors import Unavailable
from qosgate.quota.store import refusal
from qosgate.quota.verdict import Refused
from qosgate.usage import UsageRecord, UsageSummary

log = logging.getLogger(__name__)

# Errors that mean "Redis cannot answer now" (down, partitioned, failing over to a replica
# that is still read-only); anything else is a bug and propagates.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)

# While Redis is unreachable, requests get the on_error answer at once and one request per
# interval probes whether it is back: a partition must not cost every request a timeout.
PROBE_INTERVAL_S = 1.0

_T = TypeVar("_T")

# The bucket arithmetic of `TokenBucket`, in Lua, on Redis server time.
_BUCKET_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local EPSILON = 1e-9

local function bucket_read(key, rate, capacity)
  local state = redis.call('HMGET', key, 'level', 'updated')
  local level, updated = tonumber(state[1]), tonumber(state[2])
  if level == nil then
    return capacity, now
  end
  -- a time before the last update (server clock stepped back) adds nothing
  if now > updated then
    level = math.min(capacity, level + (now - updated) * rate)
    updated = now
  end
  return level, updated
end

local function bucket_write(key, rate, capacity, level, updated)
  redis.call('HSET', key, 'level', string.format('%.17g', level),
             'updated', string.format('%.17g', updated))
  -- a full bucket is the same as no key: let the key go once it would have refilled
  local refill_s = (capacity - level) / rate + math.max(0, updated - now)
  redis.call('PEXPIRE', key, math.ceil(refill_s * 1000) + 1000)
end

local function wait_s(level, capacity, rate, amount)
  local missing = math.min(amount, capacity) - level
  if missing <= EPSILON then
    return 0
  end
  return missing / rate
end

local function keep_slots(key, lease)
  redis.call('PEXPIRE', key, math.ceil(lease * 1000) + 1000)
end
"""

# KEYS: request bucket, token bucket, slots.
# ARGV: requests/s, burst, tokens/s, token capacity, cost, max concurrent, slot id, lease s;
# a limit that is not enforced is an empty string.
# Returns {1} when admitted (everything charged), else {0, rate wait, token wait, full}
# with nothing charged (waits as strings: Lua numbers would be truncated to integers).
_ACQUIRE_LUA = (
    _BUCKET_LUA
    + """
local rps, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tps, tokens_capacity = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local max_concurrent = tonumber(ARGV[6])
local rate_wait, token_wait, full = 0, 0, 0
local rate_level, rate_updated, token_level, token_updated
if rps then
  rate_level, rate_updated = bucket_read(KEYS[1], rps, burst)
  rate_wait = wait_s(rate_level, burst, rps, 1)
end
local charge_tokens = tps and cost > 0
if charge_tokens then
  token_level, token_updated = bucket_read(KEYS[2], tps, tokens_capacity)
  token_wait = wait_s(token_level, tokens_capacity, tps, cost)
end
if max_concurrent then
  -- slots whose lease ran out belong to gateways that died holding them
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_concurrent then
    full = 1
  end
end
if rate_wait > 0 or token_wait > 0 or full == 1 then
  return {0, string.format('%.17g', rate_wait), string.format('%.17g', token_wait), full}
end
if rps then
  bucket_write(KEYS[1], rps, burst, rate_level - 1, rate_updated)
end
if charge_tokens then
  bucket_write(KEYS[2], tps, tokens_capacity, token_level - cost, token_updated)
end
if max_concurrent then
  local lease = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[3], now + lease, ARGV[7])
  keep_slots(KEYS[3], lease)
end
return {1}
"""
)

# KEYS: token bucket, slots. ARGV: slot id or '', tokens/s, token capacity, tokens to take
# (> 0: used beyond the reservation, as debt) or give back (< 0), or ''.
_RELEASE_LUA = (
    _BUCKET_LUA
    + """
if ARGV[1] ~= '' then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local extra = tonumber(ARGV[4])
if extra and extra ~= 0 then
  local rate, capacity = tonumber(ARGV[2]), tonumber(ARGV[3])
  local level, updated = bucket_read(KEYS[1], rate, capacity)
  if extra > 0 then
    level = level - extra
  else
    level = math.min(capacity, level - extra)
  end
  bucket_write(KEYS[1], rate, capacity, level, updated)
end
return 1
"""
)

# KEYS: slots. ARGV: lease s, slot ids. Slots already expired or released stay gone (XX).
_RENEW_LUA = (
    _BUCKET_LUA
    + """
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
end
keep_slots(KEYS[1], lease)
return 1
"""
)

# KEYS: the day's usage hash. ARGV: prompt tokens, completion tokens, seconds to keep it.
_RECORD_DAY_LUA = """
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: the day's usage hash. Returns {requests, prompt tokens, completion tokens}.
_READ_DAY_LUA = """
local day = redis.call('HMGET', KEYS[1], 'requests', 'prompt_tokens', 'completion_tokens')
return {tonumber(day[1]) or 0, tonumber(day[2]) or 0, tonumber(day[3]) or 0}
"""

# A day's usage outlives the day, so GetUsage and a late settle still find it.
_DAY_KEPT_S = 3 * 86_400

# KEYS: the reports hash (gateway id -> report), the heartbeats sorted set (gateway id ->
# server time of its last report). ARGV: this gateway's id, its report, the time to live
# of a report in seconds. Stores the report, drops those of gateways silent for longer
# than that, returns the others'. Both keys expire once every gateway is gone.
_EXCHANGE_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do
  redis.call('HDEL', KEYS[1], gone)
  redis.call('ZREM', KEYS[2], gone)
end
local keep = math.ceil(ttl * 10000)
redis.call('PEXPIRE', KEYS[1], keep)
redis.call('PEXPIRE', KEYS[2], keep)
local others = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    table.insert(others, all[i + 1])
  end
end
return others
"""


class RedisQuotaStore:
    """A `QuotaStore` whose state is in Redis, so several gateway processes enforce each
    tenant's limits together.

    While Redis is unreachable, `on_error="deny"` raises Unavailable (UNAVAILABLE at the
    edge) and `"allow"` admits without charging; either is logged once per outage.
    Call `aclose()` at shutdown.
    """

    in_process = False

    def __init__(
        self,
        client: redis.Redis,
        *,
        clock: Clock,
        key_prefix: str = "qosgate",
        lease_s: float = 30.0,
        on_error: Literal["allow", "deny"] = "deny",
        where: str = "redis",
    ) -> None:
        """`clock` paces outage probes only; `where` names the server in logs (no secrets)."""
        self._client = client
        self._clock = clock
        self._prefix = key_prefix
        self._lease_s = lease_s
        self._on_error = on_error
        self._where = where
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._record_day = client.register_script(_RECORD_DAY_LUA)
        self._read_day = client.register_script(_READ_DAY_LUA)
        self._exchange = client.register_script(_EXCHANGE_LUA)
        # Slot ids are unique across gateways and restarts (pods often all run as pid 1).
        self._owner = f"{socket.gethostname()}/{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count()
        # Slots this process holds, per tenant; None marks a request admitted while Redis
        # was unreachable, which holds no slot there. Slots of one tenant are
        # interchangeable, so a release frees any one of them.
        self._held: dict[str, list[str | None]] = {}
        self._renewal: asyncio.Task[None] | None = None
        self._unreachable_since: float | None = None
        self._next_probe = 0.0

    @classmethod
    def from_config(cls, config: QuotaStoreConfig, *, clock: Clock) -> RedisQuotaStore:
        password = os.environ.get(config.password_env) if config.password_env else None
        client = redis.Redis.from_url(
            config.redis_url,
            password=password,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            # One immediate retry covers a pooled connection that Redis closed (restart,
            # idle timeout); more would only delay the on_error answer.
            retry=Retry(NoBackoff(), 1),
        )
        return cls(
            client,
            clock=clock,
            key_prefix=config.key_prefix,
            lease_s=config.lease_s,
            on_error=config.on_error,
            where=_safe_location(config.redis_url),
        )

    async def acquire(
        self, tenant: str, limits: LimitsConfig, now: float, cost_tokens: int
    ) -> Refused | None:
        burst = limits.effective_burst()
        tokens = limits.tokens_per_minute if cost_tokens else None
        slotted = limits.max_concurrent is not None
        if burst is None and tokens is None and not slotted:
            return None  # nothing to count: no round trip
        slot = f"{self._owner}:{next(self._ids)}" if slotted else ""
        reply = await self._call(
            self._acquire,
            keys=(
                self._rate_key(tenant, limits),
                self._tokens_key(tenant, limits),
                self._slots_key(tenant),
            ),
            args=(
                _arg(limits.requests_per_second),
                _arg(burst),
                _arg(tokens / 60.0 if tokens is not None else None),
                _arg(tokens),
                cost_tokens,
                _arg(limits.max_concurrent),
                slot,
                self._lease_s,
            ),
        )
        if reply is None:  # unreachable, failing open
            if slotted:
                self._held.setdefault(tenant, []).append(None)
            return None
        if int(reply[0]) == 1:
            if slotted:
                self._held.setdefault(tenant, []).append(slot)
                self._ensure_renewal()
            return None
        rate_wait, token_wait, full = float(reply[1]), float(reply[2]), int(reply[3]) == 1
        return refusal(tenant, limits, rate_wait, token_wait, full)

    async def release(
        self,
        tenant: str,
        limits: LimitsConfig,
        now: float,
        reserved_tokens: int,
        actual_tokens: int | None,
    ) -> None:
        slot: str | None = None
        if limits.max_concurrent is not None:
            held = self._held.get(tenant)
            if held:
                slot = held.pop()
                if slot is None:
                    return  # admitted while Redis was unreachable: nothing was charged there
        extra = 0
        if actual_tokens is not None and limits.tokens_per_minute is not None:
            extra = actual_tokens - reserved_tokens
        if slot is None and extra == 0:
            return
        per_minute = limits.tokens_per_minute
        # A failed release needs no retry: the slot, no longer renewed, expires with its
        # lease; an unsettled token estimate only errs on the strict side.
        await self._call(
            self._release,
            keys=(self._tokens_key(tenant, limits), self._slots_key(tenant)),
            args=(
                slot or "",
                _arg(per_minute / 60.0 if per_minute is not None else None),
                _arg(per_minute),
                extra if extra else "",
            ),
            raise_on_deny=False,
        )

    async def record_day_usage(self, tenant: str, day: str, record: UsageRecord) -> None:
        """Add one finished request to `tenant`'s usage on the UTC `day`, for every gateway.

        Not retried: a request Redis did not hear of is missing from the shared count (the
        outage is logged), while every gateway's own ledger still has it.
        """
        await self._call(
            self._record_day,
            keys=(self._day_key(tenant, day),),
            args=(record.prompt_tokens, record.completion_tokens, _DAY_KEPT_S),
            raise_on_deny=False,
        )

    async def day_usage(self, tenant: str, day: str) -> UsageSummary | None:
        """`tenant`'s usage on `day` across all gateways; None while Redis is unreachable
        and on_error is allow (raises Unavailable when it is deny)."""
        reply = await self._call(self._read_day, keys=(self._day_key(tenant, day),), args=())
        if reply is None:
            return None
        requests, prompt_tokens, completion_tokens = (int(n) for n in reply)
        return UsageSummary(requests, prompt_tokens, completion_tokens)

    async def exchange_reports(self, report: bytes, ttl_s: float) -> list[bytes] | None:
        """Publish this gateway's fair-share report (scheduler/cluster.py) and return the
        other live gateways' (reported within `ttl_s`); None while Redis is unreachable,
        whatever on_error says: fair share then falls back to this gateway's own, and no
        request is refused for it."""
        reply = await self._call(
            self._exchange,
            keys=(f"{self._prefix}:{{share}}:reports", f"{self._prefix}:{{share}}:beats"),
            args=(self._owner, report, ttl_s),
            raise_on_deny=False,
        )
        return None if reply is None else [bytes(r) for r in reply]

    async def aclose(self) -> None:
        """Stop renewing leases and close the connections (held slots then expire)."""
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.gather(self._renewal, return_exceptions=True)
            self._renewal = None
        await self._client.aclose()

    async def _call(
        self,
        script: Callable[..., Awaitable[_T]],
        *,
        keys: tuple[str, ...],
        args: tuple[str | bytes | int | float, ...],
        raise_on_deny: bool = True,
    ) -> _T | None:
        """Run a script; None when Redis is unreachable and the on_error policy admits."""
        if self._unreachable_since is not None and self._clock.now() < self._next_probe:
            self._refuse_if_closed(raise_on_deny)
            return None
        try:
            reply = await script(keys=keys, args=args)
        except _UNREACHABLE as e:
            now = self._clock.now()
            self._next_probe = now + PROBE_INTERVAL_S
            if self._unreachable_since is None:
                self._unreachable_since = now
                log.warning(
                    "quota store %s unreachable (%s); %s requests until it is back",
                    self._where,
                    type(e).__name__,
                    "admitting unchecked" if self._on_error == "allow" else "refusing",
                )
            self._refuse_if_closed(raise_on_deny)
            return None
        if self._unreachable_since is not None:
            log.warning(
                "quota store %s reachable again after %.1f s",
                self._where,
                self._clock.now() - self._unreachable_since,
            )
            self._unreachable_since = None
        return reply

    def _refuse_if_closed(self, raise_on_deny: bool) -> None:
        if raise_on_deny and self._on_error == "deny":
            raise Unavailable("quota store unreachable", retry_after_s=PROBE_INTERVAL_S)

    def _ensure_renewal(self) -> None:
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.get_running_loop().create_task(
                self._renew_leases(), name="quota lease renewal"
            )

    async def _renew_leases(self) -> None:
        # A third of the lease: two renewals may fail before a live request loses its slot.
        interval = self._lease_s / 3
        while True:
            await asyncio.sleep(interval)
            for tenant, held in list(self._held.items()):
                slots = [slot for slot in held if slot is not None]
                if not slots:
                    if not held:
                        del self._held[tenant]
                    continue
                await self._call(
                    self._renew,
                    keys=(self._slots_key(tenant),),
                    args=(self._lease_s, *slots),
                    raise_on_deny=False,
                )

    def _rate_key(self, tenant: str, limits: LimitsConfig) -> str:
        burst = limits.effective_burst()
        return f"{self._prefix}:{{{tenant}}}:rps:{limits.requests_per_second!r}:{burst}"

    def _tokens_key(self, tenant: str, limits: LimitsConfig) -> str:
        return f"{self._prefix}:{{{tenant}}}:tpm:{limits.tokens_per_minute}"

    def _slots_key(self, tenant: str) -> str:
        return f"{self._prefix}:{{{tenant}}}:slots"

    def _day_key(self, tenant: str, day: str) -> str:
        return f"{self._prefix}:{{{tenant}}}:day:{day}"


def _arg(value: float | None) -> str | float | int:
    return "" if value is None else value


def _safe_location(url: str) -> str:
    """host:port (or socket path) of a Redis URL, without the credentials it may carry."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix:{parts.path}"
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"
