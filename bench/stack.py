"""The processes a scenario runs against: local Triton, an nginx grpc_pass hop, the gateway.

Each lives in its own process group and is stopped as a group, so a scenario leaves
nothing behind even when it fails half-way; `Stack` is the one context a scenario enters.
Ports are picked by the OS, never fixed, because other runs share the machine.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from qosgate.launcher import LOOPBACK, LocalTriton, TritonPorts, side_by_side_cpus


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def metric_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus endpoint (Triton's metrics port, the gateway's), as
    (name, labels, value)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time of every live process in a process group, from /proc.

    /proc/<pid>/stat counts all threads of a process; fields 14 and 15 (utime, stime) are
    in clock ticks. A process that exited since is not counted, so read this while the
    group runs.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may contain spaces; the fields after it are fixed.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # field 5, pgrp
            total += int(fields[11]) + int(fields[12])
    return total / tick


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_alive(proc.pid):
        proc.poll()
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class GroupProcess:
    """A child started in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: pathlib.Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None, start_new_session=True,
            )

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.pgid)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        stop_group(self.proc)


DEMO_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "demo.yaml"


def demo_model_policies(models: Sequence[str], path: pathlib.Path = DEMO_CONFIG) -> dict[str, dict[str, Any]]:
    """The per-model settings `path` ships for `models`, read when the bench runs so that
    what it measures is what `make run` serves."""
    shipped = yaml.safe_load(path.read_text())["models"]
    return {name: dict(shipped[name]) for name in models}


NGINX_CONF = """\
worker_processes 1;
pid {dir}/nginx.pid;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream triton {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen {listen} http2;
        location / {{
            grpc_pass grpc://triton;
            grpc_read_timeout 600s;
            grpc_send_timeout 600s;
        }}
    }}
}}
"""


def nginx_config(directory: pathlib.Path, listen: str, upstream: str) -> pathlib.Path:
    """A plain gRPC reverse proxy: the reference cost of one L7 hop (one worker, like the
    single-process gateway)."""
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=directory, listen=listen, upstream=upstream))
    return conf


def gateway_config(*, listen: str, metrics_listen: str, openai_listen: str,
                   upstreams: Sequence[tuple[str, str]], tenants: Sequence[Mapping[str, Any]],
                   models: Mapping[str, Mapping[str, Any]] | None = None,
                   scheduler: Mapping[str, Any] | None = None,
                   redis_url: str | None = None) -> dict[str, Any]:
    """A gateway YAML document (qosgate.config.GatewayConfig) for one bench run;
    `upstreams`: (gRPC target, metrics URL) of each Triton; `redis_url`: the quota store
    (and fair share) shared with other gateways."""
    doc: dict[str, Any] = {
        "listen": listen,
        "metrics_listen": metrics_listen,
        "openai": {"listen": openai_listen},
        "upstreams": [
            {"name": "local" if len(upstreams) == 1 else f"triton-{i}", "url": url, "metrics_url": metrics}
            for i, (url, metrics) in enumerate(upstreams)
        ],
        "tenants": [dict(t) for t in tenants],
        # A bench tenant stands for many clients (up to 256 streams of one tenant in the
        # window scenario's flood): the per-tenant stream cap is not what is measured.
        "limits": {"max_streams_per_tenant": 1024},
    }
    if models:
        doc["models"] = {name: dict(policy) for name, policy in models.items()}
    if scheduler:
        doc["scheduler"] = dict(scheduler)
    if redis_url:
        doc["quota_store"] = {"backend": "redis", "redis_url": redis_url}
    return doc


def _death(replica: LocalTriton) -> str | None:
    """How a Triton replica ended ("... died (signal 11)"); None while it runs."""
    code = replica.exit_code()
    if code is None:
        return None
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    return f"tritonserver on {replica.ports.grpc_url} died ({how})"


class Stack:
    """Triton plus the optional hops in front of it, all stopped on exit.

    `triton_url`, `nginx_url` and `gateway_url` are `host:port` gRPC targets,
    `gateway_openai_url` the gateway's OpenAI API base URL; the hops start only when asked
    for.
    """

    def __init__(self, *, models: Sequence[str], model_repository: pathlib.Path | None = None,
                 triton_args: Sequence[str] = (), replicas: int = 1) -> None:
        self.models = list(models)
        self.replica_count = replicas
        self.model_repository = model_repository
        self.triton_args = list(triton_args)
        # Configs and logs of this run; the error messages carry the log tails that matter.
        self._tmp = tempfile.TemporaryDirectory(prefix="qosgate-bench-")
        self.dir = pathlib.Path(self._tmp.name)
        self.triton: LocalTriton | None = None  # the first replica
        self.replicas: list[LocalTriton] = []
        self.nginx: GroupProcess | None = None
        self.gateway: GroupProcess | None = None
        self.second_gateway: GroupProcess | None = None
        self.relay_alone: GroupProcess | None = None
        self.redis: GroupProcess | None = None
        self.redis_url = ""
        self.nginx_url = ""
        self.gateway_url = ""
        self.gateway_openai_url = ""
        self.gateway_metrics_url = ""
        self._exit = contextlib.ExitStack()

    @property
    def triton_url(self) -> str:
        assert self.triton is not None
        return self.triton.ports.grpc_url

    def triton_failure(self) -> str | None:
        """Why a Triton replica is gone, with its log tail; None while all of them run
        (`perf.measure`'s `watch`)."""
        for replica in self.replicas:
            death = _death(replica)
            if death is not None:
                return f"{death}; log tail:\n{replica.log_tail(20)}"
        return None

    def restart_dead_tritons(self) -> list[str]:
        """Start again, on the same ports, every Triton replica that died (its hops
        reconnect by themselves); returns the reasons they died."""
        reasons = []
        for replica in self.replicas:
            death = _death(replica)
            if death is None:
                continue
            reasons.append(death)
            replica.stop()
            replica.start()
            replica.wait_ready()
        return reasons

    def pending(self, model: str) -> int:
        """Requests the Tritons hold for `model` (queued or executing), from their metrics."""
        total = 0
        for replica in self.replicas:
            with urllib.request.urlopen(replica.ports.metrics_url, timeout=5) as resp:
                text = resp.read().decode()
            prefix = f'nv_inference_pending_request_count{{model="{model}"'
            total += sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(prefix))
        return total

    def wait_idle(self, model: str, timeout: float = 120.0) -> None:
        """Let Triton drain what an earlier phase left queued, so phases do not overlap."""
        deadline = time.monotonic() + timeout
        while self.pending(model) and time.monotonic() < deadline:
            time.sleep(0.5)

    def __enter__(self) -> Stack:
        self._exit.__enter__()
        try:
            # One replica leaves its cores to vLLM; several get a disjoint share each.
            shares = side_by_side_cpus(self.replica_count) if self.replica_count > 1 else [None]
            for i, cpus in enumerate(shares):
                ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
                replica = LocalTriton(
                    models=self.models, ports=ports, model_repository=self.model_repository,
                    log_path=self.dir / f"tritonserver-{i}.log", extra_args=self.triton_args, cpus=cpus,
                )
                self.replicas.append(replica)
                self._exit.callback(replica.stop)
                replica.start()  # side by side: the replicas load their models together
            for replica in self.replicas:
                replica.wait_ready()
            self.triton = self.replicas[0]
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()
        self._tmp.cleanup()

    def start_nginx(self) -> str:
        """nginx grpc_pass in front of Triton (stopping the one an earlier call started);
        returns its gRPC target."""
        if self.nginx is not None:
            self.nginx.stop()
        if shutil.which("nginx") is None:
            raise RuntimeError("nginx is not installed: make bench installs it (scripts/system_deps.sh nginx-light)")
        directory = self.dir / "nginx"
        directory.mkdir(exist_ok=True)
        port = free_port()
        conf = nginx_config(directory, f"{LOOPBACK}:{port}", self.triton_url)
        self.nginx = GroupProcess(
            "nginx", ["nginx", "-c", str(conf), "-p", str(directory), "-e", str(directory / "error.log")],
            directory / "stdout.log",
        )
        self._exit.callback(self.nginx.stop)
        wait_for_port(port, self.nginx.proc, "nginx")
        self.nginx_url = f"{LOOPBACK}:{port}"
        return self.nginx_url

    def start_redis(self) -> str:
        """A redis-server (no persistence) for gateways to share, stopping the one an
        earlier call started; returns its URL."""
        if self.redis is not None:
            self.redis.stop()
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: make bench installs it (scripts/system_deps.sh)")
        directory = self.dir / "redis"
        directory.mkdir(exist_ok=True)
        port = free_port()
        self.redis = GroupProcess(
            "redis", ["redis-server", "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
                      "--dir", str(directory)], directory / "redis.log")
        self._exit.callback(self.redis.stop)
        wait_for_port(port, self.redis.proc, "redis-server")
        self.redis_url = f"redis://{LOOPBACK}:{port}/0"
        return self.redis_url

    def start_relay_alone(self) -> str:
        """The gateway's relay with no policy in front of Triton (bench/relay_alone.py),
        stopping the one an earlier call started; returns its gRPC target."""
        if self.relay_alone is not None:
            self.relay_alone.stop()
        port = free_port()
        self.relay_alone = GroupProcess(
            "relay alone",
            [sys.executable, "-m", "bench.relay_alone", "--upstream", self.triton_url, "--listen", f"{LOOPBACK}:{port}"],
            self.dir / "relay-alone.log",
        )
        self._exit.callback(self.relay_alone.stop)
        wait_for_port(port, self.relay_alone.proc, "relay alone")
        return f"{LOOPBACK}:{port}"

    def start_gateway(self, *, tenants: Sequence[Mapping[str, Any]],
                      models: Mapping[str, Mapping[str, Any]] | None = None,
                      scheduler: Mapping[str, Any] | None = None, redis: bool = False) -> str:
        """`qosgate serve` with a config generated for this run (stopping the gateway an
        earlier call started); `redis`: its quota store is `start_redis`'s. Returns its
        gRPC target."""
        if self.gateway is not None:
            self.gateway.stop()
        self.gateway, port, metrics_port, http_port = self._serve_gateway(
            "gateway", tenants, models, scheduler, self._redis_url(redis))
        self.gateway_metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
        self.gateway_url = f"{LOOPBACK}:{port}"
        self.gateway_openai_url = f"http://{LOOPBACK}:{http_port}/v1"
        return self.gateway_url

    def start_second_gateway(self, *, tenants: Sequence[Mapping[str, Any]],
                             models: Mapping[str, Mapping[str, Any]] | None = None,
                             scheduler: Mapping[str, Any] | None = None, redis: bool = False) -> str:
        """Another `qosgate serve` process in front of the same Triton (with `redis`,
        sharing quotas and fair share with the first through `start_redis`'s server);
        returns its gRPC target."""
        if self.second_gateway is not None:
            self.second_gateway.stop()
        self.second_gateway, port, _, _ = self._serve_gateway(
            "second gateway", tenants, models, scheduler, self._redis_url(redis))
        return f"{LOOPBACK}:{port}"

    def _redis_url(self, wanted: bool) -> str | None:
        if not wanted:
            return None
        if not self.redis_url:
            raise RuntimeError("start_redis first")
        return self.redis_url

    def _serve_gateway(self, name: str, tenants: Sequence[Mapping[str, Any]],
                       models: Mapping[str, Mapping[str, Any]] | None,
                       scheduler: Mapping[str, Any] | None,
                       redis_url: str | None) -> tuple[GroupProcess, int, int, int]:
        """A `qosgate serve` process listening: it, its gRPC, metrics and OpenAI ports."""
        assert self.triton is not None
        port, metrics_port, http_port = free_port(), free_port(), free_port()
        doc = gateway_config(
            listen=f"{LOOPBACK}:{port}", metrics_listen=f"{LOOPBACK}:{metrics_port}",
            openai_listen=f"{LOOPBACK}:{http_port}",
            upstreams=[(r.ports.grpc_url, r.ports.metrics_url) for r in self.replicas],
            tenants=tenants, models=models, scheduler=scheduler, redis_url=redis_url,
        )
        stem = name.replace(" ", "-")
        path = self.dir / f"{stem}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        qosgate = pathlib.Path(sys.executable).with_name("qosgate")
        process = GroupProcess(name, [str(qosgate), "serve", "--config", str(path)], self.dir / f"{stem}.log")
        self._exit.callback(process.stop)
        try:
            wait_for_port(port, process.proc, "qosgate serve")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log:\n{process.log_tail()}") from exc
        return process, port, metrics_port, http_port


def leftover_processes(pgids: Sequence[int], grace: float = 15.0) -> list[int]:
    """Process groups from this run that still have a member after `grace` seconds.

    Killed members can take a few seconds to be reaped (vLLM's EngineCore exits slowly on
    a busy machine), so only what outlives the grace counts as left behind.
    """
    deadline = time.monotonic() + grace
    while True:
        left = [pgid for pgid in pgids if group_alive(pgid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@contextlib.contextmanager
def checked(stack: Stack) -> Iterator[Stack]:
    """Enter a stack and, after it stopped, fail loudly if any of its groups survived."""
    with stack:
        try:
            yield stack
        finally:
            groups = [p.pgid for p in (stack.nginx, stack.gateway, stack.second_gateway, stack.redis) if p is not None]
            groups += [r.pid for r in stack.replicas if r.pid is not None]
    # Each replica's vLLM workers are reaped in turn, slowly on a busy machine.
    left = leftover_processes(groups, grace=15.0 * max(1, len(stack.replicas)))
    if left:
        raise RuntimeError(f"process groups left behind: {left}")


def gateway_available() -> bool:
    """Whether this checkout's `qosgate` command has the `serve` subcommand yet."""
    qosgate = pathlib.Path(sys.executable).with_name("qosgate")
    out = subprocess.run([str(qosgate), "serve", "--help"], capture_output=True, check=False)
    return out.returncode == 0
