"""Wiring: one place where config becomes a running gateway.

`Gateway` builds the domain (tenants, admission, scheduler), the one edge every API's
calls go through (`edge`) and the front ends from a GatewayConfig, and owns their
lifecycle. The gRPC front end is the HTTP/2 relay on `listen` (TLS terminated there): it
serves the data path itself (KServe ModelInfer as frames, ModelStreamInfer and the other
KServe RPCs and qosgate.v1's Generation and Embedding message by message), over the
upstream pool's persistent connections to each Triton, the one transport to Triton; it
hands what is not on the data path (qosgate.v1's Admin and Batch services, gRPC health
reflecting upstream liveness, server reflection) to an in-process grpcio server on a
private unix socket. Prometheus metrics and the OpenAI API listen apart. `serve` runs it
until SIGINT/SIGTERM; `up` runs it in front of a local tritonserver and stops both.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import pathlib
import signal
import tempfile
import time
from collections.abc import Coroutine, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc
import uvloop
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from qosgate import native
from qosgate.auth import TenantDirectory
from qosgate.clock import Clock, MonotonicClock
from qosgate.config import ConfigError, GatewayConfig, ResourceLimits, UpstreamConfig, load_config
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.dataplane.generation import GenerationPlane
from qosgate.dataplane.plane import DataPlane
from qosgate.dataplane.tracing import Tracing
from qosgate.edge import Edge
from qosgate.jobs.callbacks import HttpCallbackSender
from qosgate.jobs.item_executor import PlaneItemExecutor
from qosgate.jobs.runner import JobRunner, RetryPolicy
from qosgate.jobs.sqlite_store import SqliteJobStore
from qosgate.jobs.store import JobStore
from qosgate.kserve.names import INFER, STREAM_INFER, path
from qosgate.kserve.names import SERVICE as KSERVE_SERVICE
from qosgate.launcher import LOCAL_MODELS, LocalTriton, TritonPorts
from qosgate.memory import HeapTrimmer
from qosgate.metrics import GatewayMetrics
from qosgate.metrics_http import MetricsServer
from qosgate.openai_api.batches import OpenAIBatches
from qosgate.openai_api.files import FileStore, PostgresFileStore, SqliteFileStore
from qosgate.openai_api.server import OpenAIServer
from qosgate.quota import Admission, InMemoryQuotaStore, QuotaStore, StreamLimiter
from qosgate.quota.tokens import DailyTokenBudget
from qosgate.relay.infer_policy import InferAdmissionPolicy
from qosgate.relay.kserve_rpcs import PREFIX as KSERVE_PREFIX
from qosgate.relay.kserve_rpcs import KServeRpcs
from qosgate.relay.server import Relay
from qosgate.relay.stream_infer import StreamInferHandler
from qosgate.relay.v1 import EMBEDDING as V1_EMBEDDING
from qosgate.relay.v1 import GENERATION as V1_GENERATION
from qosgate.relay.v1 import V1Calls
from qosgate.scheduler import Scheduler
from qosgate.scheduler.cluster import ClusterExchange
from qosgate.services.admin import AdminServicer
from qosgate.services.batch import BatchService
from qosgate.services.handlers import Handlers, servicer_methods
from qosgate.tls import HTTP1_ALPN, server_context
from qosgate.transport import http2
from qosgate.upstream import UpstreamPool
from qosgate.upstream.engine import Engine
from qosgate.upstream.engine_load import EngineLoadReader
from qosgate.usage import UsageLedger, UsageMeter
from qosgate.v1 import admin_pb2, batch_pb2, embedding_pb2, generation_pb2

if TYPE_CHECKING:
    from qosgate.quota.redis_store import RedisQuotaStore

log = logging.getLogger(__name__)



def _server_options(limits: ResourceLimits) -> tuple[tuple[str, int], ...]:
    # gRPC refuses a message over max_receive RESOURCE_EXHAUSTED from its length prefix,
    # before buffering it.
    return (
        ("grpc.max_receive_message_length", limits.max_request_bytes),
        ("grpc.max_send_message_length", limits.max_response_bytes),
        ("grpc.so_reuseport", 0),
    )


# Calls one client connection may have open at once. Calls waiting for admission or a
# dispatch slot are open streams, and the scheduler's queue bounds are what bound them: a
# lower cap made a client queue its critical calls behind its own waiting batch calls
# (minilm's critical p99 grew to 7 s under the 4x flood at 1,000). grpcio set none.
# The bytes those waiting calls hold are bounded by `limits.connection_pending_bytes`.
_CALLS_PER_CONNECTION = 1 << 16


# The longest path a unix socket may have (sockaddr_un.sun_path, less its NUL).
_MAX_UNIX_PATH = 107


def _service(module: ModuleType, name: str) -> ServiceDescriptor:
    return module.DESCRIPTOR.services_by_name[name]


class Gateway:
    """The gateway process's parts, started and stopped together."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        clock: Clock | None = None,
        serve_metrics: bool = True,
        health_check_interval_s: float = 1.0,
    ) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.metrics = GatewayMetrics(known_models=config.models)
        self.pool = UpstreamPool(
            config.upstreams,
            check_interval_s=health_check_interval_s,
            routing=lambda model: config.model_policy(model).routing,
            metrics=self.metrics,
        )
        self._health_check_interval_s = health_check_interval_s
        self.scheduler = Scheduler(config, self.clock)
        self._engine_load = EngineLoadReader(
            ((u.name, u.metrics_url) for u in config.upstreams if u.metrics_url),
            self.scheduler.engine_load,
            self.pool.engine_load,
        )
        self.directory = TenantDirectory(config)
        self._shared_quota = self._redis_quota(config, self.clock)
        quota_store: QuotaStore = self._shared_quota or InMemoryQuotaStore()
        # Gateways sharing Redis share each model's fair share too (scheduler/cluster.py).
        self._cluster = (
            ClusterExchange(self._shared_quota, self.scheduler.cluster_report, self.scheduler.cluster_update)
            if self._shared_quota is not None
            else None
        )
        self.admission = Admission(quota_store, self.clock)
        self.streams = StreamLimiter(config.limits.max_streams_per_tenant)
        self.heap = HeapTrimmer()
        self.state_dir = config.state_directory()
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"state_dir {self.state_dir}: cannot create it: {e.strerror}; "
                "set `state_dir` to a directory this user may write"
            ) from None
        self.ledger = UsageLedger(config.usage_db or self.state_dir / "usage.sqlite3", wall_time=time.time)
        # With Redis, budgets and GetUsage count the day's usage of every gateway.
        self.usage = UsageMeter(self.ledger, wall_time=time.time, shared=self._shared_quota)
        self.tracing = Tracing.from_config(config.tracing)
        # The one request path every API's calls take (dataplane/plane.py).
        self.dataplane = DataPlane(
            directory=self.directory,
            admission=self.admission,
            budget=DailyTokenBudget(wall_time=time.time, totals=self.usage),
            scheduler=self.scheduler,
            usage=self.usage,
            metrics=self.metrics,
            tracing=self.tracing,
            clock=self.clock,
            output_token_weight=config.scheduler.output_token_weight,
        )
        # The one edge every API's calls go through (identify, class, deadline, admit, route).
        self.edge = Edge(config=config, plane=self.dataplane, upstreams=self.pool)
        self.engine = Engine(self.pool, max_response_bytes=config.limits.max_response_bytes)
        self.generation = GenerationPlane(config=config, edge=self.edge, engine=self.engine, clock=self.clock)
        self.embedding = EmbeddingPlane(config=config, edge=self.edge, engine=self.engine, clock=self.clock)
        self.jobs, self.openai_files = self._job_stores(config, self.state_dir)
        self.batch_runner = JobRunner(
            self.jobs,
            PlaneItemExecutor(self.generation, self.embedding),
            self.directory.named,
            wall_time=time.time,
            callbacks=HttpCallbackSender(),
            klass=config.batch_class(),
            completion_window_s=config.batch.completion_window_hours * 3600,
            lease_renew_interval_s=config.job_store.lease_s / 3,
            max_in_flight=config.batch.max_in_flight,
            retry=RetryPolicy(
                max_attempts=config.batch.max_attempts,
                base_delay_s=config.batch.retry_base_delay_s,
                max_delay_s=config.batch.retry_max_delay_s,
            ),
        )
        self.openai: OpenAIServer | None = None
        self._batch_task: asyncio.Task[None] | None = None
        self.health = health.aio.HealthServicer()
        self._serve_metrics = serve_metrics
        self._metrics_endpoint: MetricsServer | None = None
        # What /readyz says (read from the metrics thread): gRPC health's SERVING.
        self._ready = False
        self._stopping = False
        self._server: grpc.aio.Server | None = None
        self._relay: Relay | None = None
        self._grpcio_dir: tempfile.TemporaryDirectory[str] | None = None
        self.port: int | None = None

    @staticmethod
    def _redis_quota(config: GatewayConfig, clock: Clock) -> RedisQuotaStore | None:
        """Redis when several gateway replicas must enforce one set of limits together.
        Its client (like psycopg, below) is imported only where it is configured: the two
        were a sixth of the imports of every gateway start."""
        if config.quota_store.backend != "redis":
            return None
        from qosgate.quota.redis_store import RedisQuotaStore

        return RedisQuotaStore.from_config(config.quota_store, clock=clock)

    @staticmethod
    def _job_stores(config: GatewayConfig, state_dir: pathlib.Path) -> tuple[JobStore, FileStore]:
        """The batch jobs' store and, beside it, the OpenAI files': PostgreSQL when several
        gateway replicas must serve the same batch jobs (a file uploaded through one
        replica is then there for the others), else SQLite files."""
        settings = config.job_store
        if settings.backend == "postgres":
            from qosgate.jobs.postgres_store import PostgresJobStore

            jobs = PostgresJobStore(
                settings.postgres_url,
                wall_time=time.time,
                password=os.environ.get(settings.password_env) if settings.password_env else None,
                pool_size=settings.pool_size,
                timeout_s=settings.timeout_s,
                lease_s=settings.lease_s,
            )
            return jobs, PostgresFileStore(jobs, wall_time=time.time)
        return (
            SqliteJobStore(config.batch.db or state_dir / "batch.sqlite3", wall_time=time.time, lease_s=settings.lease_s),
            SqliteFileStore(config.openai.files_db or state_dir / "openai_files.sqlite3", wall_time=time.time),
        )

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_endpoint.port if self._metrics_endpoint else None

    @property
    def http_port(self) -> int | None:
        """The OpenAI API's port once started; None when it is disabled."""
        return self.openai.port if self.openai else None

    async def start(self) -> None:
        """Bind `config.listen` (port 0 picks a free one: see `.port`) and start serving."""
        await self.jobs.open()
        await self.openai_files.open()
        server = grpc.aio.server(options=_server_options(self.config.limits))
        # What is not on the data path: identified by the same edge, parsed, answered.
        handlers = Handlers(self.edge)
        services = {
            _service(admin_pb2, "AdminService"): AdminServicer(self.directory, self.usage),
            _service(batch_pb2, "BatchService"): BatchService(
                directory=self.directory, store=self.jobs, runner=self.batch_runner, config=self.config.batch
            ),
        }
        server.add_generic_rpc_handlers(
            tuple(handlers.handler(d.full_name, servicer_methods(d, s)) for d, s in services.items())
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # Reflection lists every service the listener serves, the relay's included.
        reflection.enable_server_reflection(
            (
                KSERVE_SERVICE,
                _service(generation_pb2, "GenerationService").full_name,
                _service(embedding_pb2, "EmbeddingService").full_name,
                *(d.full_name for d in services),
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        tls = self.config.tls
        # The relay owns `listen` and hands every call it does not serve itself to this
        # server, which only it can reach (a directory of this process's user only, in the
        # state directory: the one place the gateway writes).
        self._grpcio_dir = tempfile.TemporaryDirectory(prefix="grpcio-", dir=self.state_dir)
        socket_path = f"{self._grpcio_dir.name}/grpcio.sock"
        if len(os.fsencode(socket_path)) > _MAX_UNIX_PATH:
            raise OSError(f"state_dir {self.state_dir} is too long for its unix socket ({socket_path}): "
                          f"at most {_MAX_UNIX_PATH} bytes")
        grpcio_address = f"unix:{socket_path}"
        if server.add_insecure_port(grpcio_address) == 0:
            raise OSError(f"cannot listen on {grpcio_address}")

        self.pool.on_health_change(self._publish_health)
        await self._publish_health(False)
        relay = self._open_relay()
        # The upstreams' connections write through the relay's flusher: a call's bytes to
        # Triton and to its caller leave in the same pass of the event loop.
        await self.pool.start(relay.flusher)
        self._engine_load.start()
        if self._cluster is not None:
            self._cluster.start()
        self.metrics.watch(
            self.scheduler.snapshot, lambda: ((u.name, u.live) for u in self.pool.upstreams)
        )
        if self._serve_metrics:
            self._metrics_endpoint = MetricsServer(self.config.metrics_listen, self.metrics.registry, lambda: self._ready)
        # Bound before gRPC serves: once health answers SERVING, the HTTP API is up too.
        if self.config.openai.enabled:
            self.openai = OpenAIServer(
                config=self.config.openai,
                edge=self.edge,
                generation=self.generation,
                embedding=self.embedding,
                pool=self.pool,
                batches=OpenAIBatches(
                    files=self.openai_files,
                    jobs=self.jobs,
                    runner=self.batch_runner,
                    directory=self.directory,
                    config=self.config.batch,
                    max_file_bytes=self.config.openai.max_file_bytes,
                    max_stored_bytes=self.config.openai.max_stored_bytes,
                ),
                tls=server_context(tls, HTTP1_ALPN) if tls is not None else None,
            )
            await self.openai.start()
        await server.start()
        self._server = server
        self.port = await self._serve_relay(relay, grpcio_address)
        # Batch items re-queued after a restart start as soon as the gateway serves.
        self._batch_task = asyncio.get_running_loop().create_task(self.batch_runner.run(), name="batch runner")
        log.info(
            "qosgate listening on %s (port %d, %s), OpenAI API on %s, metrics and health on %s; %s",
            self.config.listen,
            self.port,
            "plaintext" if tls is None else "TLS" if tls.client_ca is None else "mutual TLS",
            f"port {self.http_port}" if self.openai else "(off)",
            self.config.metrics_listen if self._serve_metrics else "(off)",
            self.config.summary(),
        )
        if not native.compiled():
            log.warning("the per-call modules run interpreted (about a quarter more CPU per call): "
                        "`make native` compiles them")
        if not http2.TRIMS_PADDED_VALUES:
            log.warning("ngh2 is PyPI's build: a header value with spaces around it (`authorization: "
                        "Bearer ` with an empty key) resets the caller's stream instead of being trimmed; "
                        "`python scripts/build_ngh2.py` in a checkout installs the build that trims it")

    def _open_relay(self) -> Relay:
        """The relay, not listening yet: the upstream pool's connections write through
        its flusher, and the health checks go over them before the relay serves."""
        limits = self.config.limits
        tls = self.config.tls
        self._relay = Relay(
            max_message_size=limits.max_request_bytes,
            max_concurrent_streams=_CALLS_PER_CONNECTION,
            max_connection_pending=limits.connection_pending_bytes,
            tls=server_context(tls) if tls is not None else None,
        )
        return self._relay

    async def _serve_relay(self, relay: Relay, grpcio_address: str) -> int:
        """The relay on `listen`: ModelInfer relayed to the Tritons under the gateway's
        policy, ModelStreamInfer, the other KServe RPCs and qosgate.v1's data calls served
        message by message, every other call to the grpcio server; returns the port."""
        limits = self.config.limits
        grpcio = relay.upstream(grpcio_address, connections=1)
        await grpcio.start()
        edge = self.edge
        policy = InferAdmissionPolicy(edge=edge, heap=self.heap, max_request_fields=limits.max_request_fields)
        # The policy names each call's upstream (its route): the route has no pool of its own.
        relay.route(path(INFER), None, policy, max_response_size=limits.max_response_bytes)
        relay.serve(path(STREAM_INFER), StreamInferHandler(edge=edge, streams=self.streams, limits=limits, heap=self.heap))
        relay.serve(
            KSERVE_PREFIX,
            KServeRpcs(edge=edge, engine=self.engine, directory=self.directory, max_request_fields=limits.max_request_fields),
        )
        v1 = V1Calls(edge=edge, generation=self.generation, embedding=self.embedding)
        relay.serve(V1_GENERATION, v1)
        relay.serve(V1_EMBEDDING, v1)
        relay.route(b"/", grpcio)
        host, _, port = self.config.listen.rpartition(":")
        return await relay.listen(host.strip("[]"), int(port))

    def reload(self, new: GatewayConfig) -> list[str]:
        """Apply `new`'s tenants now: keys, weights, classes, models, limits, budgets.

        Returns the other top-level keys that differ in `new`: those take a restart and are
        not applied. Raises ConfigError, changing nothing, if the tenants do not fit.
        """
        merged = self.config.with_tenants_of(new)
        self.directory.replace(merged)
        pending = self.config.keys_needing_restart(new)
        self.config = merged
        return pending

    async def _publish_health(self, upstream_live: bool) -> None:
        """SERVING while at least one upstream is live. Not per model: a model loading or
        unloading leaves the gateway serving every other model (and that one's metadata)."""
        self._ready = upstream_live and not self._stopping
        state = (
            health_pb2.HealthCheckResponse.SERVING if upstream_live else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", KSERVE_SERVICE):
            await self.health.set(service, state)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new calls, give running ones `grace_s`, then close upstreams and metrics."""
        self._stopping = True
        self._ready = False
        await self.health.enter_graceful_shutdown()
        if self.openai is not None:
            await self.openai.stop()
            self.openai = None
        if self._relay is not None:
            await self._relay.close()
            self._relay = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._batch_task is not None:
            # Items in flight stay `running` in the store and re-run at the next start.
            self._batch_task.cancel()
            await asyncio.gather(self._batch_task, return_exceptions=True)
            self._batch_task = None
        await self._engine_load.close()
        if self._cluster is not None:
            await self._cluster.close()
        self.heap.close()
        await self.pool.close()
        if self._shared_quota is not None:
            await self._shared_quota.aclose()
        self.ledger.close()
        await self.jobs.close()
        await self.openai_files.close()
        self.tracing.shutdown()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.stop()
        if self._grpcio_dir is not None:
            self._grpcio_dir.cleanup()
            self._grpcio_dir = None
            self._metrics_endpoint = None


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run the gateway's event loop on uvloop: the relay's per-call cost is mostly the
    event loop's socket and callback work, which uvloop does in C."""
    uvloop.run(main)


async def serve(config: GatewayConfig, *, path: str | os.PathLike[str] | None = None) -> None:
    """Run a gateway until SIGINT or SIGTERM; SIGHUP reloads the tenants from `path`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    gateway = Gateway(config)
    handlers = {signal.SIGINT: stop.set, signal.SIGTERM: stop.set}
    if path is not None:
        handlers[signal.SIGHUP] = lambda: _reload(gateway, path)
    for sig, handler in handlers.items():
        loop.add_signal_handler(sig, handler)
    await gateway.start()
    # What startup built (modules, config, protobuf descriptors: over 100k objects) lives as
    # long as the process. Frozen, it is left out of the cyclic collector's full passes,
    # which otherwise walk all of it (30-50 ms on the bench machine) while calls wait.
    gc.collect()
    gc.freeze()
    try:
        await stop.wait()
        log.info("stopping qosgate")
    finally:
        await gateway.stop()
        for sig in handlers:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def _reload(gateway: Gateway, path: str | os.PathLike[str]) -> None:
    """SIGHUP: re-read the config file; a bad file is logged and the running config kept."""
    try:
        pending = gateway.reload(load_config(path))
    except ConfigError as e:
        log.error("config reload failed, still running the previous config:\n%s", e)
        return
    log.info("config reloaded from %s: %s", os.fspath(path), gateway.config.summary())
    if pending:
        log.warning("changed keys not applied until a restart: %s", ", ".join(pending))


def up(
    config: GatewayConfig,
    *,
    models: tuple[str, ...] = LOCAL_MODELS,
    path: str | os.PathLike[str] | None = None,
) -> None:
    """Run a local tritonserver and the gateway in front of it until SIGINT/SIGTERM.

    The gateway's upstreams are replaced by the local server. Triton is stopped on every
    way out, including a signal while it is still loading models.
    """
    with _stopped_by_sigterm():
        ports = TritonPorts()
        with LocalTriton(models=models, ports=ports):
            local_triton = UpstreamConfig(name="local", url=ports.grpc_url, metrics_url=ports.metrics_url)
            local = config.model_copy(update={"upstreams": [local_triton]})
            run(serve(local, path=path))


def triton(*, models: tuple[str, ...] = LOCAL_MODELS) -> None:
    """Run only the local tritonserver, on its default ports, until SIGINT/SIGTERM."""
    with _stopped_by_sigterm():
        ports = TritonPorts()
        with LocalTriton(models=models, ports=ports):
            log.info("tritonserver serving %s on %s (gRPC), metrics %s; Ctrl-C stops it",
                     ", ".join(models), ports.grpc_url, ports.metrics_url)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM unwinds (SystemExit) instead of killing the process, so a LocalTriton's
    context manager stops Triton's process group on that way out too."""

    def interrupted(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
