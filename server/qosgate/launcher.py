"""Run a real local tritonserver: the binary from the nvidia-pytriton wheel, on loopback.

Used by `qosgate up` and by the integration tests. The wheel ships the server, the python
backend and one backend stub per Python version; we assemble a backend directory for the
running interpreter (plus our own `vllm` backend, a Python-based backend) and start the
server in its own process group so that stopping it also stops vLLM's EngineCore
children, which otherwise outlive a killed tritonserver.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from qosgate import paths

log = logging.getLogger(__name__)

# The models the local CPU stack serves (`qosgate up`, `qosgate triton`).
LOCAL_MODELS = ("smollm2", "smollm2_trtllm", "minilm", "identity")

LOOPBACK = "127.0.0.1"


class TritonStartError(RuntimeError):
    """tritonserver exited or did not become ready; the message carries the log tail."""


class TritonStartTimeout(TritonStartError):
    """tritonserver still ran, not ready, when the wait for it ran out (it is stopped)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TritonPorts:
    grpc: int = 8001
    http: int = 8000
    metrics: int = 8002

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics}/metrics"


def _pytriton_dirs() -> tuple[pathlib.Path, pathlib.Path]:
    """(pytriton/tritonserver, nvidia_pytriton.libs) inside site-packages."""
    try:
        import pytriton  # the wheel's Python package; we use only its bundled server
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TritonStartError(
            "nvidia-pytriton is not installed: the local tritonserver comes with the `[local]` "
            "extra (`make setup` installs it in a checkout)"
        ) from exc
    site = pathlib.Path(pytriton.__file__).resolve().parent.parent
    return site / "pytriton" / "tritonserver", site / "nvidia_pytriton.libs"


def assemble_backends(target: pathlib.Path) -> pathlib.Path:
    """Build a --backend-directory for this interpreter; idempotent.

    backends/python: the python backend .so, its utils and the stub matching the running
    Python. backends/vllm: our Python-based vLLM backend (model.py from this repo).
    """
    server_dir, _ = _pytriton_dirs()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonStartError(f"nvidia-pytriton has no python backend stub for Python {version}")
    # Triton refuses a backend library whose real path lies outside the backend
    # directory ("escapes backend directory"), so the python backend is copied.
    copies = {
        target / "python" / "libtriton_python.so": server_dir / "backends/python/libtriton_python.so",
        target / "python" / "triton_python_backend_utils.py": server_dir
        / "backends/python/triton_python_backend_utils.py",
        target / "python" / "triton_python_backend_stub": stub,
    }
    for copy, source in copies.items():
        copy.parent.mkdir(parents=True, exist_ok=True)
        if copy.is_file() and not copy.is_symlink() and _same_file_content(copy, source):
            continue
        copy.unlink(missing_ok=True)
        shutil.copy2(source, copy)
    # Our own backend stays a link, so an edited model.py is live at the next load.
    link = target / "vllm" / "model.py"
    source = paths.project_root() / "backends" / "vllm" / "model.py"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and link.resolve() == source.resolve()):
        link.unlink(missing_ok=True)
        link.symlink_to(source)
    return target


def _same_file_content(a: pathlib.Path, b: pathlib.Path) -> bool:
    sa, sb = a.stat(), b.stat()
    return sa.st_size == sb.st_size and int(sa.st_mtime) == int(sb.st_mtime)


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver and its python stubs need (see ENVIRONMENT notes).

    - the interpreter's own LIBDIR first on LD_LIBRARY_PATH, or the stub may load the
      system libpython and fail with an undefined symbol;
    - the wheel's bundled libs (libcudart et al.) on LD_LIBRARY_PATH;
    - the virtualenv on PATH/VIRTUAL_ENV: that is how the stub finds site-packages;
    - a UTF-8 locale; model weights read offline from the cache filled at setup.
    """
    env = dict(os.environ if base is None else base)
    _, libs = _pytriton_dirs()
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ld = [p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = ":".join(ld)
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = sys.prefix
    env["LANG"] = env["LC_ALL"] = "C.UTF-8"
    env.setdefault("HF_HOME", str(paths.hf_home()))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def side_by_side_cpus(count: int) -> list[list[int]]:
    """Disjoint CPU sets for `count` replicas run side by side on this host, from the CPUs
    this process may use; where there are fewer CPUs than replicas, replicas share them
    round robin.

    vLLM on a CPU binds its compute threads to cores it picks alone: on a host with two
    cores, every engine took core 0 and left the other to its scheduler. Two replicas then
    ran on one core, and one engine's generation starved the other's: a call spilled to
    the second replica got its first token only when the first replica's calls ended
    (29 s later, against 1.5 s with a core each).
    """
    if count < 1:
        raise ValueError("count must be at least 1")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return [[cpus[i % len(cpus)]] for i in range(count)]
    share = len(cpus) // count
    return [cpus[i * share : (i + 1) * share] for i in range(count)]


class LocalTriton:
    """A tritonserver child process bound to loopback, in its own process group.

    `models` are loaded explicitly at start (model control mode "explicit", so repository
    load/unload work through the API too). Use as a context manager, or call
    start()/wait_ready()/stop().

    `cpus`, when given, are the CPUs the vLLM engines' compute threads are bound to
    (vLLM's VLLM_CPU_OMP_THREADS_BIND); replicas side by side on one host take theirs
    from side_by_side_cpus(). None leaves the choice to vLLM, right for one replica.
    """

    def __init__(
        self,
        *,
        models: Sequence[str],
        ports: TritonPorts = TritonPorts(),
        model_repository: pathlib.Path | None = None,
        work_dir: pathlib.Path | None = None,
        log_path: pathlib.Path | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        self.models = list(models)
        self.ports = ports
        self.model_repository = model_repository or paths.model_repository()
        self.work_dir = work_dir or paths.cache_dir() / "triton"
        self.log_path = log_path or self.work_dir / f"tritonserver-{ports.grpc}.log"
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        if cpus is not None:
            if not cpus:
                raise ValueError("cpus must name at least one CPU")
            self.extra_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(cpu) for cpu in cpus)
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        server_dir, _ = _pytriton_dirs()
        backends = assemble_backends(self.work_dir / "backends")
        cmd = [
            str(server_dir / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in self.models),
            f"--grpc-address={LOOPBACK}",
            f"--grpc-port={self.ports.grpc}",
            f"--http-address={LOOPBACK}",
            f"--http-port={self.ports.http}",
            f"--metrics-address={LOOPBACK}",
            f"--metrics-port={self.ports.metrics}",
            "--allow-metrics=true",
            "--log-verbose=0",
            # In-flight requests get this long to finish at stop; a local stack is stopped
            # by Ctrl-C, where waiting Triton's default 30 s helps nobody.
            "--exit-timeout-secs=5",
            *self.extra_args,
        ]
        return cmd

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = server_environment()
        env.update(self.extra_env)
        cmd = self.command()
        log.info("starting tritonserver: models=%s grpc=%s log=%s", self.models, self.ports.grpc_url, self.log_path)
        with open(self.log_path, "wb") as log_file:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # own process group: stop() signals all of it
            )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def exit_code(self) -> int | None:
        """The server's exit status if it has exited since start (a negative one is the
        signal that ended it), None while it runs or when it was not started."""
        return self._proc.poll() if self._proc else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def _ready(self) -> bool:
        url = f"http://{LOOPBACK}:{self.ports.http}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the server and every requested model are ready.

        Raises TritonStartError with the log tail if the server exits (a model that fails
        to load makes tritonserver exit in explicit mode), TritonStartTimeout if the timeout
        passes (the server is stopped).
        """
        if self._proc is None:
            raise RuntimeError("not started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise TritonStartError(
                    f"tritonserver exited with code {code} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._ready():
                log.info("tritonserver ready on %s", self.ports.grpc_url)
                return
            time.sleep(0.5)
        self.stop()
        raise TritonStartTimeout(
            f"tritonserver was not ready after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server, then the rest of its process group, then SIGKILL.

        The server goes first so that its models shut down their engines themselves; a
        group-wide SIGTERM would kill vLLM's EngineCore under a model still using it.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("tritonserver did not stop in %.0fs; killing its process group", timeout)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        # Children (vLLM EngineCore, python stubs) may linger after the server itself.
        _kill_group(proc.pid)
        proc.wait()

    def __enter__(self) -> LocalTriton:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group(pgid: int, grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
