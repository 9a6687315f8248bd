"""The gateway's declarative configuration: one YAML file, validated whole at load.

Every model is frozen, so a loaded config is an immutable snapshot that a reload can swap
atomically. Errors name the file, the path of the offending key (`tenants[1].limits.burst`)
and the reason, one line each, in the manner of envoyproxy/ratelimit.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import pathlib
import re
import ssl
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from qosgate import paths

DEFAULT_CLASSES = ("critical", "interactive", "standard", "batch")

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


# What a request of a model without token counts costs in fair share (scheduler/cost.py).
CostUnit = Literal["request", "text", "byte"]


class ConfigError(Exception):
    """A config file that cannot be used; the message has one `FILE: key.path: reason` per line."""


class _FieldProblem(ValueError):
    """A cross-field check failure that knows the key path (relative to the model checked).

    pydantic reports a model validator's error at the model itself; carrying the path in
    the exception lets the formatter point at the exact key instead.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path = path
        self.reason = reason


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def _pem_file(path: str, what: str) -> str:
    """`path` if it is a readable file of PEM certificates (`what` names them in errors)."""
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    not_pem = ValueError(f"{path} is not {what} (PEM)")
    if b"-----BEGIN CERTIFICATE-----" not in pem:  # e.g. a key given where a cert belongs
        raise not_pem
    # The ssl module parses every certificate in the file.
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError):
        raise not_pem from None
    return path


def _no_password() -> str:
    raise ValueError("encrypted")


def _check_key_pair(cert: str, key: str, key_field: str) -> None:
    """Raise _FieldProblem at `key_field` unless `key` is a readable, unencrypted PEM
    private key that belongs to the first certificate in `cert` (already checked)."""
    try:
        with open(key, "rb"):
            pass
    except OSError as e:
        raise _FieldProblem(key_field, f"cannot read {key}: {e.strerror}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, ValueError):
        # The reason only, never the key's content: the ssl module's messages carry none.
        raise _FieldProblem(
            key_field, f"{key} is not an unencrypted PEM private key for the certificate {cert}"
        ) from None


class UpstreamTlsConfig(_Frozen):
    """TLS to one Triton endpoint (Triton's --grpc-use-ssl); mutual when cert and key are set."""

    ca: str | None = None
    """PEM file of the CA certificates that Triton's server certificate must chain to;
    default: the system's trusted roots."""
    cert: str | None = None
    """PEM file of the gateway's client certificate chain, for a Triton that requires
    client certificates (--grpc-use-ssl-mutual); needs `key`."""
    key: str | None = None
    """PEM file of the private key of `cert` (unencrypted)."""

    @field_validator("ca")
    @classmethod
    def _ca_parses(cls, path: str | None) -> str | None:
        return None if path is None else _pem_file(path, "a CA certificate file")

    @field_validator("cert")
    @classmethod
    def _cert_parses(cls, path: str | None) -> str | None:
        return None if path is None else _pem_file(path, "a certificate file")

    @model_validator(mode="after")
    def _pair(self) -> UpstreamTlsConfig:
        if (self.cert is None) != (self.key is None):
            raise ValueError("set both cert and key, or neither")
        if self.cert is not None and self.key is not None:
            _check_key_pair(self.cert, self.key, "key")
        return self


class UpstreamConfig(_Frozen):
    """A Triton endpoint the gateway forwards to."""

    name: str = Field(min_length=1)
    """Label used in logs and metrics."""
    url: str = Field(min_length=1)
    """gRPC address `host:port` of Triton's GRPCInferenceService."""
    tls: UpstreamTlsConfig | None = None
    """TLS to this endpoint; unset: plaintext (right for a Triton on loopback)."""
    metrics_url: str | None = None
    """Triton's Prometheus metrics (`http://host:8002/metrics`): where `auto` dispatch
    windows read the engines' waiting queue and KV-cache use; unset: latency alone."""


class ListenerTlsConfig(_Frozen):
    """TLS on the gateway's gRPC listener; mutual TLS when `client_ca` is set."""

    cert: str
    """PEM file of the gateway's certificate chain (leaf first), valid for the names and
    addresses clients connect to."""
    key: str
    """PEM file of the private key of `cert` (unencrypted; keep it readable only by the
    gateway's user)."""
    client_ca: str | None = None
    """PEM file of the CA certificates that client certificates must chain to. When set,
    every client must present a certificate (mutual TLS); a tenant's `client_certs` can
    then identify it without an API key."""

    @field_validator("cert")
    @classmethod
    def _cert_parses(cls, path: str) -> str:
        return _pem_file(path, "a certificate file")

    @field_validator("client_ca")
    @classmethod
    def _ca_parses(cls, path: str | None) -> str | None:
        return None if path is None else _pem_file(path, "a CA certificate file")

    @model_validator(mode="after")
    def _key_matches(self) -> ListenerTlsConfig:
        _check_key_pair(self.cert, self.key, "key")
        return self


class ClientCertConfig(_Frozen):
    """A client certificate that identifies a tenant (mutual TLS), by one of two forms."""

    sha256: str | None = None
    """SHA-256 fingerprint of the certificate (DER), 64 hex digits, colons allowed
    (`openssl x509 -in client.pem -noout -fingerprint -sha256`): exactly this one
    certificate; a renewed certificate needs its new fingerprint here."""
    san: str | None = None
    """A subjectAltName entry of the certificate (DNS name, URI such as a SPIFFE ID, or
    e-mail address): any certificate from `tls.client_ca` that carries it, so renewals
    need no config change. Only as safe as that CA: use a CA that issues only to your
    clients."""

    @model_validator(mode="after")
    def _exactly_one(self) -> ClientCertConfig:
        if (self.sha256 is None) == (self.san is None):
            raise ValueError("set exactly one of sha256, san")
        if self.sha256 is not None and not _SHA256_HEX.match(self.fingerprint() or ""):
            raise _FieldProblem("sha256", "must be 64 hex digits (colons allowed)")
        if self.san is not None and not self.san:
            raise _FieldProblem("san", "must not be empty")
        return self

    def fingerprint(self) -> str | None:
        """The fingerprint in the form the gateway compares: lower-case hex, no colons."""
        return None if self.sha256 is None else self.sha256.replace(":", "").lower()

    def identity(self) -> tuple[str, str]:
        """What a presented certificate is matched on: ("sha256", hex) or ("san", name)."""
        fingerprint = self.fingerprint()
        return ("sha256", fingerprint) if fingerprint is not None else ("san", self.san or "")


class ApiKeyConfig(_Frozen):
    """One API key of a tenant: its SHA-256 (preferred) or, for demos, the key itself."""

    sha256: str | None = None
    """Lower-case hex SHA-256 of the key (`printf %s KEY | sha256sum`)."""
    key: SecretStr | None = None
    """The key in plain text; for demo configs only."""

    @model_validator(mode="after")
    def _exactly_one(self) -> ApiKeyConfig:
        if (self.sha256 is None) == (self.key is None):
            raise ValueError("set exactly one of sha256, key")
        if self.sha256 is not None and not _SHA256_HEX.match(self.sha256):
            raise _FieldProblem("sha256", "must be 64 lower-case hex digits")
        if self.key is not None and not self.key.get_secret_value():
            raise _FieldProblem("key", "must not be empty")
        return self

    def digest(self) -> bytes:
        """The key's SHA-256; the only form in which the gateway keeps or compares keys."""
        if self.sha256 is not None:
            return bytes.fromhex(self.sha256)
        assert self.key is not None
        return hashlib.sha256(self.key.get_secret_value().encode()).digest()


class LimitsConfig(_Frozen):
    """A tenant's quotas; a limit left out is not enforced (`max_streams`: the gateway's
    default applies)."""

    requests_per_second: float | None = Field(default=None, gt=0)
    """Sustained request rate (token bucket refill rate)."""
    burst: int | None = Field(default=None, ge=1)
    """Bucket capacity: requests allowed at once after idling; default ceil(requests_per_second)."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """Requests of this tenant admitted and not yet finished, queued or in flight."""
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """LLM tokens (prompt + generated) per minute, as a bucket of that capacity."""
    max_inflight_tokens: int | None = Field(default=None, ge=1)
    """Tokens (prompt + max_tokens) of this tenant's LLM requests at the engines at once;
    past it, its requests wait queued in the gateway (others pass them). A request that
    alone holds more is refused RESOURCE_EXHAUSTED."""
    daily_token_budget: int | None = Field(default=None, ge=1)
    """LLM tokens per UTC day, counted in the persistent usage ledger (generation API);
    with a Redis quota store, in day totals there that every gateway adds to."""
    max_streams: int | None = Field(default=None, ge=1)
    """ModelStreamInfer calls this tenant may have open at once on one gateway; default:
    `limits.max_streams_per_tenant`. Counted per gateway process, even with a Redis quota
    store: what it bounds is this process's memory and upstream streams."""

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> LimitsConfig:
        if self.burst is not None and self.requests_per_second is None:
            raise _FieldProblem("burst", "burst requires requests_per_second")
        return self

    def counted(self) -> bool:
        """Whether a quota store counts this tenant's requests (a request rate, a
        concurrency, a token rate or a daily budget): with a shared store, a round trip."""
        return not (
            self.requests_per_second is None
            and self.max_concurrent is None
            and self.tokens_per_minute is None
            and self.daily_token_budget is None
        )

    def effective_burst(self) -> int | None:
        if self.requests_per_second is None:
            return None
        return self.burst if self.burst is not None else max(1, math.ceil(self.requests_per_second))


class TenantConfig(_Frozen):
    """A tenant: who it is (its keys), what it may do, and its share and limits."""

    name: str = Field(min_length=1)
    """Unique name, used in logs, metrics and usage records."""
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    """Keys that identify this tenant (`authorization: Bearer KEY` or `x-api-key: KEY`)."""
    client_certs: list[ClientCertConfig] = Field(default_factory=list)
    """Client certificates that identify this tenant without a key (needs `tls.client_ca`)."""
    weight: float = Field(default=1.0, gt=0)
    """Fair-share weight against other tenants inside the same class."""
    default_class: str | None = None
    """Class of requests that send no `x-priority`; default: the gateway's `default_class`."""
    max_class: str | None = None
    """Highest class this tenant may ask for; default: its default class."""
    models: list[str] = Field(default_factory=lambda: ["*"])
    """fnmatch patterns of the models it may use and see."""
    admin: bool = False
    """May call admin-only RPCs (model load/unload, shared memory, trace and log settings)."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """Quotas; none by default."""


class SchedulerConfig(_Frozen):
    """How queued requests are ordered between classes and tenants, and when they are shed."""

    floor_share: float = Field(default=0.05, ge=0, lt=1)
    """Minimum share of dispatches each class below the highest gets while it has work."""
    floor_share_by_class: dict[str, float] = Field(default_factory=dict)
    """Per-class overrides of `floor_share`."""
    max_queue_length: int = Field(default=1000, ge=1)
    """Requests that may wait per model and class; more are refused UNAVAILABLE."""
    max_queue_length_by_class: dict[str, int] = Field(default_factory=dict)
    """Per-class overrides of `max_queue_length`."""
    sheddable_classes: list[str] | None = None
    """Classes whose queued requests may be shed under overload, lowest first;
    default: every class but the highest. The highest class is never sheddable."""
    shed_retry_after_s: float = Field(default=1.0, gt=0)
    """Retry hint sent with UNAVAILABLE when a request is shed or its queue is full."""
    window_reserve: float = Field(default=0.25, ge=0, lt=1)
    """Share of each model's dispatch window held back from lower classes, growing down
    the class list: the highest class may fill the whole window, the lowest only
    (1 - window_reserve) of it, those between in equal steps (at least one slot each).
    A higher-class request then finds a slot free at Triton at once instead of waiting
    for lower-class work there to finish. A class whose anti-starvation floor is due may
    still use the whole window. 0: every class may fill the window."""
    fair_share: Literal["cost", "requests"] = "cost"
    """What fair share between the tenants of a class counts: `cost` (each request's cost:
    LLM tokens, prompt + output_token_weight x max_tokens, corrected when it finishes;
    other models the unit of their `cost_unit`) or `requests` (every request counts 1)."""
    output_token_weight: float = Field(default=2.0, ge=0)
    """Cost of an output token against a prompt token in an LLM request's cost (VTC's w)."""
    latency_objective: dict[str, float] = Field(default_factory=dict)
    """Per class, the first-response latency it may reach under load, as a multiple of
    its unloaded latency (e.g. `{critical: 2.0}`): while the class is active and slower,
    the classes below it get less of each `auto` window (their requests wait in the
    gateway); none by default (a higher class is protected by its reserved slots and the
    engine's own priority, and lower classes keep the engine at full throughput)."""


class RoutingConfig(_Frozen):
    """How one model's calls are spread over the upstreams (docs/scale-out.md, "Routing")."""

    policy: Literal["least_loaded", "prefix_affinity"] = "least_loaded"
    """`least_loaded`: the upstream with the fewest calls in flight.
    `prefix_affinity`: calls whose prompts begin alike (or that carry one session id) go
    to one upstream, where the engine's prefix cache has their prefix, within the load
    bound. Generation API and OpenAI routes; KServe calls by session header only."""
    prefix_bytes: int = Field(default=1024, ge=1)
    """How many leading bytes of the rendered prompt make the affinity key: about the
    length of the shared part (system prompt, template); longer keys reach into the
    per-request text and scatter calls that share a prefix."""
    load_factor: float = Field(default=2.0, ge=1)
    """No upstream takes a call that would bring its calls in flight above load_factor x
    the average over the candidates (rounded up); such a call goes to the
    next upstream on the key's ring. 1: strict balance, larger: more affinity. The
    default, 2, lets the replica owning a larger share of the keys keep them (on two
    replicas it never spills); a tighter bound spills calls to replicas whose caches
    lack their prefix (docs/scale-out.md, "Routing across replicas")."""
    max_engine_waiting: int | None = Field(default=4, ge=0)
    """An upstream whose engine has more requests waiting than this for the model (read
    from its `metrics_url`) is saturated and passed over; null: engine queues ignored.
    This is what keeps a hot prefix from piling onto one of two replicas (where the
    default load bound never binds) while the other's engine has free seats. An engine
    that is not saturated holds a request or two between its steps, so the default
    leaves it a few."""
    session_header: str | None = Field(default=None, min_length=1)
    """Request header whose value, when present, is the affinity key instead of the
    prompt (e.g. `x-session-id`): all calls of one session go to one upstream."""

    @field_validator("session_header")
    @classmethod
    def _lower_case(cls, value: str | None) -> str | None:
        # gRPC metadata keys and our parsed HTTP headers are lower case.
        return None if value is None else value.lower()


class ModelPolicy(_Frozen):
    """How the gateway feeds one Triton model."""

    dispatch_window: int | Literal["auto"] = "auto"
    """Requests in flight at Triton for this model; the rest wait in the gateway's queues.
    `auto`: sized by the gateway between `window_min` and `window_max` from the engine's
    saturation (its waiting queue or a batcher's pending requests, KV-cache use), with
    caps on classes for fair share and latency objectives (README, "dispatch_window: auto")."""
    window_min: int = Field(default=2, ge=1)
    """Smallest window `auto` shrinks to."""
    window_max: int = Field(default=256, ge=1)
    """Largest window `auto` grows to. The engine's saturation (its waiting queue, its
    KV cache) stops the window first: this only bounds an engine that reports neither."""
    cost_unit: CostUnit = "request"
    """Fair-share cost of a request without token counts (embedding calls, KServe calls
    other than an LLM's generation requests):
    `request` 1 each, `text` 1 per input text (an embedding call) or batch row (the first
    dimension of a KServe call's first input), `byte` 1 per byte of the request."""
    max_queued: int = Field(default=2000, ge=1)
    """Requests queued for this model (all classes) before overload shedding starts."""
    exclusive_classes: list[str] = Field(default_factory=list)
    """Classes that have the model's engine to themselves: while a request of one of them
    is in flight at Triton, requests of the classes below it wait in the gateway (a lower
    class whose floor is due still goes). For an engine that runs one batch at a time
    (Triton's dynamic batcher): lower-class work sent after such a request cannot join
    its batch, nor keep the model's instances busy while it waits. Not for LLMs, whose
    requests stay in flight for a whole generation."""
    kserve_token_counts: bool = False
    """ModelStreamInfer requests of the vLLM backend's contract: ask the engine for its token
    counts (the `return_num_input_tokens`/`return_num_output_tokens` flags, added where the
    caller did not set them, their outputs taken out of the responses again unless it asked
    for them) and charge those. Off: the prompt's estimate and one token per streamed
    response with outputs (a request not streamed: max_tokens), which undercounts a stream
    whose engine merged deltas. Only for a model that declares those inputs (Triton rejects
    a request with an input its model does not declare)."""
    adapter: Literal["vllm", "trtllm"] = "vllm"
    """Generation API only: the model's tensor contract, `vllm` (vLLM backend) or `trtllm`
    (TensorRT-LLM ensemble)."""
    chat_template: str = "chatml"
    """Generation API only: Jinja2 chat template (Hugging Face dialect) that renders chat
    messages into the prompt, or the name of a built-in one (`chatml`)."""
    default_max_tokens: int = Field(default=256, ge=1)
    """Generation API only: max_tokens of requests that set none."""
    default_temperature: float | None = Field(default=None, ge=0)
    """Generation API only: temperature of requests that set none (0 = greedy); unset:
    the engine's own default."""
    default_top_p: float | None = Field(default=None, gt=0, le=1)
    """Generation API only: top_p of requests that set none; unset: the engine's default."""
    tokenizer: str | None = None
    """Generation API only: the model's tokenizer (a tokenizer.json, its folder, or a
    Hugging Face model id in the local cache) for exact prompt token counts; unset: an
    estimate that leans high (the vLLM adapter then takes the engine's count)."""
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """Which upstream gets each call of this model."""

    @field_validator("dispatch_window", mode="before")
    @classmethod
    def _window_positive(cls, value: Any) -> Any:
        valid = value == "auto" or (type(value) is int and value >= 1)
        if not valid:
            raise ValueError("must be `auto` or an integer >= 1")
        return value

    @model_validator(mode="after")
    def _window_bounds(self) -> ModelPolicy:
        if self.window_min > self.window_max:
            raise _FieldProblem("window_min", "must not be above window_max")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_compiles(cls, source: str) -> str:
        from qosgate.adapters.chat_template import ChatTemplate, TemplateError

        try:
            ChatTemplate(source)
        except TemplateError as e:
            raise ValueError(str(e)) from None
        return source


class BatchTenantLimits(_Frozen):
    """One tenant's batch limits, overriding the defaults in `batch`."""

    max_queued_items: int | None = Field(default=None, ge=1)
    """Items this tenant may have waiting or running over all its jobs."""
    retention_hours: float | None = Field(default=None, gt=0)
    """How long a finished job and its results are kept."""


class BatchConfig(_Frozen):
    """Batch jobs (qosgate.v1.BatchService): storage, dispatch, retries and limits."""

    db: str | None = None
    """SQLite file of jobs, items and results (`job_store.backend: sqlite`); relative
    paths are relative to the working directory; default `<state_dir>/batch.sqlite3`."""
    priority_class: str | None = None
    """Class that batch items are scheduled at; default: the lowest class, so every other
    class wins the dispatch windows."""
    max_in_flight: int = Field(default=16, ge=1)
    """Batch items handed to the scheduler at a time (over all jobs): enough to keep an
    engine's batches full when nothing else runs, few enough that the batch class queue
    stays short. What reaches the engine the scheduler decides: the batch class fills at
    most its share of the dispatch window, the slots `window_reserve` keeps free wait for
    the classes above."""
    max_attempts: int = Field(default=5, ge=1)
    """Dispatches of an item before a transient error (UNAVAILABLE, DEADLINE_EXCEEDED,
    INTERNAL) becomes its final result; quota refusals do not count."""
    retry_base_delay_s: float = Field(default=0.5, gt=0)
    """First retry backoff; it doubles per attempt up to `retry_max_delay_s`."""
    retry_max_delay_s: float = Field(default=30.0, gt=0)
    """Longest retry backoff."""
    max_queued_items: int = Field(default=10_000, ge=1)
    """Default per-tenant limit on items waiting or running over all its jobs."""
    retention_hours: float = Field(default=168.0, gt=0)
    """Default time a finished job and its results are kept."""
    tenants: dict[str, BatchTenantLimits] = Field(default_factory=dict)
    """Per-tenant overrides, by tenant name."""
    callback_allowlist: list[str] = Field(default_factory=list)
    """URL prefixes completion callbacks may use (scheme, host:port and path prefix must
    match); empty: callbacks are refused."""
    completion_window_hours: float = Field(default=24.0, gt=0)
    """How long a job's items may take from the job's creation: each item's call has what
    is left of it as its deadline, and an item not done when it passes fails
    DEADLINE_EXCEEDED for good (OpenAI batches promise `24h`)."""


class JobStoreConfig(_Frozen):
    """Where batch jobs, their items and results live."""

    backend: Literal["sqlite", "postgres"] = "sqlite"
    """`sqlite`: the embedded file `batch.db`, owned by this gateway alone; `postgres`: a
    PostgreSQL database shared by every gateway that uses it, so any of them serves any
    job of the tenant and takes over the items of one that died."""
    postgres_url: str = "postgresql://qosgate@127.0.0.1:5432/qosgate"
    """PostgreSQL server and database (libpq URL: `postgresql://user@host:port/db`,
    options such as `?sslmode=require` included); no password here, see `password_env`."""
    password_env: str | None = None
    """Environment variable holding the PostgreSQL password (keeps it out of the config)."""
    pool_size: int = Field(default=4, ge=1)
    """PostgreSQL connections this gateway keeps open at most."""
    timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait for a PostgreSQL connection or one statement; past it the call fails
    UNAVAILABLE."""
    lease_s: float = Field(default=30.0, gt=0)
    """Lease of a dispatched item: renewed every third of it while the item runs, so the
    items of a gateway that died go back to the queue after at most this long (plus a
    third of it) and another gateway runs them."""

    @field_validator("postgres_url")
    @classmethod
    def _postgres_scheme(cls, url: str) -> str:
        if not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql:// or postgres://")
        # Config files get copied, shown and committed; a password goes in password_env.
        if urlsplit(url).password is not None:
            raise ValueError("must not contain a password: name its variable in password_env")
        return url


_MiB = 1 << 20
# gRPC's message length options are C ints.
_GRPC_MAX_MESSAGE = (1 << 31) - 1


class ResourceLimits(_Frozen):
    """Bounds on what one caller can make the gateway hold: every buffer has a limit, so a
    slow or hostile client costs memory and time of its own, never everyone's."""

    max_request_bytes: int = Field(default=64 * _MiB, ge=1024, le=_GRPC_MAX_MESSAGE)
    """Largest request message the gateway accepts, on every RPC. gRPC refuses a larger
    one RESOURCE_EXHAUSTED as it arrives, before buffering it whole."""
    connection_pending_bytes: int = Field(default=256 * _MiB, ge=1024)
    """Request bytes one client connection may have the gateway hold while the policy
    decides on its calls (first messages of calls being admitted or waiting for a
    dispatch slot: read whole before the decision, so the caller's flow-control window does
    not bound them). A call whose bytes would go over it is refused RESOURCE_EXHAUSTED;
    the connection's other calls, and every other connection, go on."""
    max_response_bytes: int = Field(default=64 * _MiB, ge=1024, le=_GRPC_MAX_MESSAGE)
    """Largest response message the gateway takes from Triton and passes on; a larger one
    fails the call RESOURCE_EXHAUSTED."""
    max_request_fields: int = Field(default=4096, ge=16)
    """Protobuf fields (top-level and inside parameters) the gateway reads in one
    inference request to find its model name and id; a request with more is refused
    INVALID_ARGUMENT. The cost of routing a request stays bounded however it is crafted;
    a real request has a few fields per tensor."""
    max_streams_per_tenant: int = Field(default=32, ge=1)
    """ModelStreamInfer calls one tenant may have open at once (override per tenant:
    `tenants[].limits.max_streams`); more are refused RESOURCE_EXHAUSTED with RetryInfo."""
    stream_buffer_bytes: int = Field(default=4 * _MiB, ge=1024)
    """Responses of one ModelStreamInfer call waiting for its caller to read them. When
    full, the gateway stops reading that stream's responses from Triton and stops taking
    new requests from the caller; the stream's requests already at Triton give their
    dispatch slots back, so a caller that does not read slows only its own stream."""
    stream_max_pending: int = Field(default=64, ge=1)
    """Requests of one ModelStreamInfer call read from the caller and not finished
    (queued or at Triton); the gateway reads the caller's next request when one ends."""


class QuotaStoreConfig(_Frozen):
    """Where tenants' request-rate, concurrency and token-rate state lives."""

    backend: Literal["memory", "redis"] = "memory"
    """`memory`: in this gateway process (one replica); `redis`: in a Redis server shared
    by every gateway process that uses it, so the limits hold for all replicas together."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis server: `redis://host:port/db`, `rediss://` for TLS, `unix:///path`."""
    password_env: str | None = None
    """Environment variable holding the Redis password (keeps it out of the config file)."""
    key_prefix: str = Field(default="qosgate", min_length=1)
    """Prefix of every Redis key; gateways that share quotas use the same prefix."""
    lease_s: float = Field(default=30.0, gt=0)
    """Lease of a concurrency slot in Redis: renewed while its request runs, so the slots
    of a gateway that died without releasing them expire after at most this long."""
    timeout_s: float = Field(default=0.25, gt=0)
    """Timeout of one Redis call; past it, Redis counts as unreachable."""
    on_error: Literal["allow", "deny"] = "deny"
    """While Redis is unreachable: `deny` refuses requests UNAVAILABLE (limits are never
    exceeded), `allow` admits them unchecked (availability over limits)."""

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return url


class OpenAIConfig(_Frozen):
    """The OpenAI-compatible HTTP API, served by the gateway process beside gRPC."""

    enabled: bool = True
    """Serve the OpenAI API; false: gRPC only."""
    listen: str = "127.0.0.1:8080"
    """HTTP listen address `host:port` (port 0 picks a free one)."""
    service_tiers: dict[str, str] = Field(default_factory=dict)
    """OpenAI `service_tier` value -> priority class (`{priority: critical, flex: batch}`).
    `auto` and `default` mean the tenant's default class unless mapped here; any other
    unmapped tier is refused 400. An `x-priority` header wins over `service_tier`."""
    files_db: str | None = None
    """SQLite file of uploaded batch input files and the OpenAI fields of batches
    (`job_store.backend: sqlite`; with `postgres` they live in the shared database);
    relative paths are relative to the working directory; default
    `<state_dir>/openai_files.sqlite3`."""
    max_file_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Largest batch input file accepted by `POST /v1/files`."""
    max_stored_bytes: int = Field(default=1024 * 1024 * 1024, ge=1)
    """Most bytes of uploaded files one tenant keeps stored: an upload that would pass it
    is refused 400 until the tenant deletes files (`DELETE /v1/files/{id}`)."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    """Largest JSON body of the other endpoints, as sent and as decoded (gzip, deflate)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of a request that gives none (a `timeout` or `x-stainless-timeout` header,
    in seconds, sets its own): a request still queued or running when it passes ends 504."""


class TracingConfig(_Frozen):
    """OpenTelemetry traces of every inference call (a span per call; children for the
    queue wait, the upstream call and the time to first token). Off by default; a
    caller's W3C `traceparent` is forwarded to Triton either way."""

    otlp_endpoint: str | None = None
    """OTLP/gRPC collector address (`host:port` or `http://host:port`); unset: no spans
    are recorded or exported."""
    insecure: bool = True
    """Plaintext OTLP (a collector on the same host or network); false: TLS with the
    system's CAs."""
    service_name: str = "qosgate"
    """The `service.name` resource attribute of the exported spans."""
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of calls traced when the caller sent no sampling decision (parent-based
    otherwise: a caller's sampled `traceparent` is always traced)."""


class GatewayConfig(_Frozen):
    """The whole gateway configuration (docs/configuration.md)."""

    listen: str = "127.0.0.1:50051"
    """gRPC listen address of the gateway."""
    metrics_listen: str = "127.0.0.1:9464"
    """Prometheus metrics HTTP address."""
    upstreams: list[UpstreamConfig] = Field(
        default_factory=lambda: [UpstreamConfig(name="local", url="127.0.0.1:8001")]
    )
    """Triton endpoints; requests go to a live one."""
    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_CLASSES), min_length=1)
    """Priority classes, highest first; Triton priority level = position (1 = highest)."""
    default_class: str | None = None
    """Class of tenants that set no `default_class`; default `standard` if it is a class,
    else the lowest class."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Queueing between classes and tenants."""
    models: dict[str, ModelPolicy] = Field(default_factory=dict)
    """Per-model policies, by Triton model name."""
    default_model_policy: ModelPolicy = Field(default_factory=ModelPolicy)
    """Policy of models not listed in `models`."""
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Who may call the gateway."""
    state_dir: str | None = None
    """Directory of the gateway's own files: every SQLite file whose key is unset
    (`usage_db`, `batch.db`, `openai.files_db`) and the private socket of its in-process
    gRPC server. Relative paths are relative to the working directory; default: the
    checkout's `.cache/` when run from a checkout, else `$XDG_DATA_HOME/qosgate`
    (`~/.local/share/qosgate`)."""
    usage_db: str | None = None
    """SQLite file of the token usage ledger (daily budgets, GetUsage); relative paths are
    relative to the working directory; default `<state_dir>/usage.sqlite3`."""
    batch: BatchConfig = Field(default_factory=BatchConfig)
    """Batch jobs."""
    quota_store: QuotaStoreConfig = Field(default_factory=QuotaStoreConfig)
    """Where quota state lives: this process, or Redis shared by all gateway replicas."""
    tls: ListenerTlsConfig | None = None
    """TLS on `listen`; unset: plaintext (right for loopback only)."""
    job_store: JobStoreConfig = Field(default_factory=JobStoreConfig)
    """Where batch jobs live: this gateway's SQLite file, or PostgreSQL shared by all
    gateway replicas."""
    limits: ResourceLimits = Field(default_factory=ResourceLimits)
    """Message sizes, streams per tenant and stream buffers (see `ResourceLimits`)."""
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)
    """The OpenAI-compatible HTTP API."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry tracing and its OTLP exporter (off by default)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> GatewayConfig:
        for problem in self._problems():
            raise problem
        return self

    def _problems(self) -> Iterator[_FieldProblem]:
        levels: dict[str, int] = {}
        for i, name in enumerate(self.classes):
            if not name:
                yield _FieldProblem(f"classes[{i}]", "class name must not be empty")
            if name in levels:
                yield _FieldProblem(f"classes[{i}]", f"duplicate class {name!r}")
            levels.setdefault(name, i)

        def unknown(path: str, klass: str) -> _FieldProblem:
            return _FieldProblem(
                path, f"unknown class {klass!r} (classes: {', '.join(self.classes)})"
            )

        if self.default_class is not None and self.default_class not in levels:
            yield unknown("default_class", self.default_class)
        seen_upstreams: set[str] = set()
        for i, upstream in enumerate(self.upstreams):
            if upstream.name in seen_upstreams:
                yield _FieldProblem(f"upstreams[{i}].name", f"duplicate upstream {upstream.name!r}")
            seen_upstreams.add(upstream.name)

        sched = self.scheduler
        for klass, share in sched.floor_share_by_class.items():
            if klass not in levels:
                yield unknown(f"scheduler.floor_share_by_class.{klass}", klass)
            elif not 0 <= share < 1:
                yield _FieldProblem(f"scheduler.floor_share_by_class.{klass}", "must be in [0, 1)")
        if sum(self.floor_share(c) for c in self.classes) >= 1:
            yield _FieldProblem(
                "scheduler", "floor shares of the lower classes must sum to less than 1"
            )
        for klass, length in sched.max_queue_length_by_class.items():
            if klass not in levels:
                yield unknown(f"scheduler.max_queue_length_by_class.{klass}", klass)
            elif length < 1:
                yield _FieldProblem(f"scheduler.max_queue_length_by_class.{klass}", "must be >= 1")
        for klass, objective in sched.latency_objective.items():
            if klass not in levels:
                yield unknown(f"scheduler.latency_objective.{klass}", klass)
            elif not objective > 1:
                yield _FieldProblem(f"scheduler.latency_objective.{klass}", "must be above 1 (a multiple of the unloaded latency)")
        policies = {f"models.{name}": policy for name, policy in self.models.items()}
        policies["default_model_policy"] = self.default_model_policy
        for where, policy in policies.items():
            for i, klass in enumerate(policy.exclusive_classes):
                if klass not in levels:
                    yield unknown(f"{where}.exclusive_classes[{i}]", klass)
        for i, klass in enumerate(sched.sheddable_classes or ()):
            if klass not in levels:
                yield unknown(f"scheduler.sheddable_classes[{i}]", klass)
            elif levels[klass] == 0:
                yield _FieldProblem(
                    f"scheduler.sheddable_classes[{i}]",
                    f"the highest class {klass!r} is never sheddable",
                )

        names: dict[str, int] = {}
        digests: dict[bytes, str] = {}
        cert_owners: dict[tuple[str, str], str] = {}
        for i, tenant in enumerate(self.tenants):
            where = f"tenants[{i}]"
            if tenant.name in names:
                yield _FieldProblem(f"{where}.name", f"duplicate tenant {tenant.name!r}")
            names.setdefault(tenant.name, i)
            for j, key in enumerate(tenant.api_keys):
                digest = key.digest()
                if digest in digests:
                    yield _FieldProblem(
                        f"{where}.api_keys[{j}]",
                        f"duplicate API key (also used by tenant {digests[digest]!r})",
                    )
                digests[digest] = tenant.name
            for j, cert in enumerate(tenant.client_certs):
                cert_path = f"{where}.client_certs[{j}]"
                if self.tls is None or self.tls.client_ca is None:
                    yield _FieldProblem(cert_path, "client certificates need tls.client_ca (mutual TLS)")
                identity = cert.identity()
                if identity in cert_owners:
                    yield _FieldProblem(
                        cert_path,
                        f"duplicate client certificate {identity[0]} (also used by tenant {cert_owners[identity]!r})",
                    )
                cert_owners.setdefault(identity, tenant.name)
            for field in ("default_class", "max_class"):
                klass = getattr(tenant, field)
                if klass is not None and klass not in levels:
                    yield unknown(f"{where}.{field}", klass)
            default = tenant.default_class or self.gateway_default_class()
            highest = tenant.max_class or default
            if default in levels and highest in levels and levels[default] < levels[highest]:
                yield _FieldProblem(
                    f"{where}.default_class",
                    f"default class {default!r} is above max_class {highest!r}",
                )
            for j, pattern in enumerate(tenant.models):
                if not pattern:
                    yield _FieldProblem(f"{where}.models[{j}]", "model pattern must not be empty")

        for tier, klass in self.openai.service_tiers.items():
            if klass not in levels:
                yield unknown(f"openai.service_tiers.{tier}", klass)
        if self.batch.priority_class is not None and self.batch.priority_class not in levels:
            yield unknown("batch.priority_class", self.batch.priority_class)
        for name in self.batch.tenants:
            if name not in names:
                yield _FieldProblem(f"batch.tenants.{name}", f"unknown tenant {name!r}")

    def gateway_default_class(self) -> str:
        if self.default_class is not None:
            return self.default_class
        return "standard" if "standard" in self.classes else self.classes[-1]

    def batch_class(self) -> str:
        """The class batch items are scheduled at."""
        return self.batch.priority_class or self.classes[-1]

    def class_level(self, klass: str) -> int:
        """Triton priority level of a class: 1 for the highest. Raises KeyError if unknown."""
        try:
            return self.classes.index(klass) + 1
        except ValueError:
            raise KeyError(klass) from None

    def floor_share(self, klass: str) -> float:
        """Minimum dispatch share of a class while it has work; 0 for the highest class."""
        if klass == self.classes[0]:
            return 0.0
        return self.scheduler.floor_share_by_class.get(klass, self.scheduler.floor_share)

    def max_queue_length(self, klass: str) -> int:
        return self.scheduler.max_queue_length_by_class.get(klass, self.scheduler.max_queue_length)

    def model_policy(self, model: str) -> ModelPolicy:
        return self.models.get(model, self.default_model_policy)

    def with_tenants_of(self, other: GatewayConfig) -> GatewayConfig:
        """This config with `other`'s tenants, checked as a whole (a reload applies this).

        Raises ConfigError when the new tenants do not fit this config (a class it does not
        have, a batch override for a tenant that is gone).
        """
        merged = self.model_copy(update={"tenants": other.tenants})
        problems = [f"{p.path}: {p.reason}" for p in merged._problems()]
        if problems:
            raise ConfigError("\n".join(problems))
        return merged

    def keys_needing_restart(self, other: GatewayConfig) -> list[str]:
        """Top-level keys other than `tenants` whose value differs in `other`."""
        return [
            key
            for key in type(self).model_fields
            if key != "tenants" and getattr(self, key) != getattr(other, key)
        ]

    def state_directory(self) -> pathlib.Path:
        """`state_dir`, or its default (see the field)."""
        return pathlib.Path(self.state_dir) if self.state_dir else paths.default_state_dir()

    def summary(self) -> str:
        admins = sum(t.admin for t in self.tenants)
        return (
            f"{len(self.tenants)} tenants ({admins} admin), {len(self.classes)} classes, "
            f"{len(self.models)} model policies, {len(self.upstreams)} upstreams, "
            f"listen {self.listen}"
        )


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and validate a YAML config; raises ConfigError naming file, key path and reason."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{name}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{name}: {where}: invalid YAML: {problem}") from None
    return parse_config(raw, source=name)


def parse_config(raw: Any, *, source: str = "<config>") -> GatewayConfig:
    """Validate an already-parsed YAML document; errors are reported as from `source`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: (root): expected a mapping, got {type(raw).__name__}")
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as e:
        lines = [f"{source}: {_key_path(err)}: {_reason(err)}" for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def _key_path(err: Any) -> str:
    parts: list[str] = []
    for item in err["loc"]:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(f".{item}" if parts else str(item))
    problem = err.get("ctx", {}).get("error")
    if isinstance(problem, _FieldProblem):
        parts.append(f".{problem.path}" if parts else problem.path)
    return "".join(parts) or "(root)"


def _reason(err: Any) -> str:
    problem = err.get("ctx", {}).get("error")
    if isinstance(problem, _FieldProblem):
        return problem.reason
    if err["type"] == "extra_forbidden":
        return _unknown_key(err["loc"])
    message = str(err["msg"])
    return message.removeprefix("Value error, ")


def _unknown_key(loc: tuple[str | int, ...]) -> str:
    """What to say of the unknown key at `loc`: the known key it likely meant, else the
    keys that are known there."""
    known = sorted(_model_at(loc[:-1]).model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (known here: {', '.join(known)})"


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel]:
    """The config model that holds the keys at `loc` (a path pydantic reported)."""
    kind: Any = GatewayConfig
    for part in loc:
        kind = _the_model(kind) or kind
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            kind = kind.model_fields[str(part)].annotation
        else:  # a list's index or a dict's key: on to the element's type
            kind = get_args(kind)[-1]
    model = _the_model(kind)
    assert model is not None, loc
    return model


def _the_model(kind: Any) -> type[BaseModel] | None:
    """`kind` if it is a config model, or the model in a union such as `TlsConfig | None`."""
    union = get_origin(kind) in (Union, types.UnionType)
    for candidate in (kind, *get_args(kind)) if union else (kind,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
