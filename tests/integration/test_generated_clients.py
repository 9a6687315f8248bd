"""The Go, Java and C++ clients (clients/go, clients/java, clients/cpp) against the real
stack: Triton with smollm2, minilm and identity, the gateway in-process.

Each language's README.md is the source of what runs here, so that it cannot drift: its
build block (`make clients-<language>`), each line of its example block (checked by what
that command must print), its excerpts (found verbatim in the example's source) and its
walkthrough (a program written from protos/ alone, built in a directory that holds nothing
else). The library's behaviour is then driven through the same example program: the key,
the class, RetryInfo and the retry that waits it, the deadline, TLS with the test CA.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from certificates import CertificateAuthority
from conftest import require_model
from gateway_harness import ACME_KEY, GLOBEX_KEY, GatewayThread, gateway_config
from qosgate import paths
from qosgate.launcher import LocalTriton
from qosgate_client import Client

pytestmark = pytest.mark.integration

ROOT = paths.project_root()
LANGUAGES = ("go", "java", "cpp")
COMMANDS = ("generate", "stream", "embed", "batch", "infer")
# A tenant per language with a burst of one: of two calls in a row (`--repeat 2`) the
# second is refused and told to wait up to 1 / QUOTA_RATE seconds.
QUOTA_RATE = 0.5
WRONG_KEY = "not-a-key-3f9a"
BLOCK = re.compile(r"<!-- (example|excerpt|walkthrough): (.+?) -->\n```\w*\n(.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class Readme:
    """The tagged blocks of clients/<language>/README.md: `<!-- KIND: WHAT -->` before a
    fenced block."""

    path: Path
    blocks: tuple[tuple[str, str, str], ...]

    def one(self, kind: str, what: str) -> str:
        found = self.optional(kind, what)
        assert found, f"{self.path}: no '{kind}: {what}' block"
        return found

    def optional(self, kind: str, what: str) -> str:
        """The block's text, or "" when there is none."""
        found = [text for k, w, text in self.blocks if (k, w) == (kind, what)]
        assert len(found) <= 1, f"{self.path}: {len(found)} '{kind}: {what}' blocks"
        return found[0] if found else ""

    def files(self) -> dict[str, str]:
        """The walkthrough's source files by name (`<!-- walkthrough: file NAME -->`)."""
        return {w.removeprefix("file "): text for k, w, text in self.blocks
                if k == "walkthrough" and w.startswith("file ")}

    def excerpts(self) -> list[tuple[str, str]]:
        """(source file, text) of each `<!-- excerpt: PATH -->` block."""
        return [(w, text) for k, w, text in self.blocks if k == "excerpt"]


@functools.cache
def readme(language: str) -> Readme:
    path = ROOT / "clients" / language / "README.md"
    return Readme(path, tuple(BLOCK.findall(path.read_text())))


@dataclasses.dataclass(frozen=True)
class Invocation:
    """One command line of the example: its flags, command and operands."""

    flags: dict[str, str]
    command: str
    operands: list[str]


def split(words: list[str]) -> tuple[list[str], Invocation]:
    """The program (the words before the first flag or command) and what follows it."""
    start = next(i for i, w in enumerate(words) if w.startswith("--") or w in COMMANDS)
    rest = words[start:]
    flags = {}
    while rest[0].startswith("--"):
        flags[rest[0]] = rest[1]
        rest = rest[2:]
    return words[:start], Invocation(flags, rest[0], rest[1:])


def example_lines() -> list[object]:
    return [
        pytest.param(language, line, id=f"{language}-{split(shlex.split(line))[1].command}")
        for language in LANGUAGES
        for line in readme(language).one("example", "run").splitlines()
    ]


@dataclasses.dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float


def bash(script: str, *, cwd: Path, env: dict[str, str], timeout: float = 600) -> Done:
    started = time.monotonic()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return Done(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def environment(target: str, key: str) -> dict[str, str]:
    # Go's build cache (the user's, which `make clients-go` filled) spares the
    # walkthrough compiling gRPC again.
    return {**os.environ, "QOSGATE_TARGET": target, "QOSGATE_API_KEY": key}


@dataclasses.dataclass(frozen=True)
class Example:
    """A language's example program, as its README runs it."""

    language: str
    program: list[str]

    def run(self, gateway: GatewayThread, *args: str, key: str = ACME_KEY) -> Done:
        return bash(shlex.join([*self.program, *args]), cwd=ROOT, env=environment(gateway.url, key),
                    timeout=180)


@functools.cache
def built(language: str) -> Example:
    """Runs the README's build block (a no-op when `make test` built it already)."""
    doc = readme(language)
    done = bash(doc.one("example", "build"), cwd=ROOT, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = doc.one("example", "run").splitlines()[0]
    return Example(language, split(shlex.split(first))[0])


def quota_key(language: str) -> str:
    return f"test-quota-{language}-key"


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    for model in ("smollm2", "minilm", "identity"):
        require_model(model)
    tenants = [
        {"name": "acme", "api_keys": [{"key": ACME_KEY}], "max_class": "critical"},
        {
            "name": "globex",
            "api_keys": [{"key": GLOBEX_KEY}],
            "models": ["minilm", "identity"],
            "max_class": "interactive",
        },
        *(
            {
                "name": f"quota-{language}",
                "api_keys": [{"key": quota_key(language)}],
                "limits": {"requests_per_second": QUOTA_RATE, "burst": 1},
            }
            for language in LANGUAGES
        ),
    ]
    with GatewayThread(gateway_config(triton.ports.grpc_url, tenants=tenants)) as gateway:
        yield gateway


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    rogue: CertificateAuthority


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    return Pki(CertificateAuthority(directory, "qosgate"), CertificateAuthority(directory, "rogue"))


@pytest.fixture(scope="module")
def tls_gateway(triton: LocalTriton, pki: Pki) -> Iterator[GatewayThread]:
    server = pki.ca.server()
    tls = {"cert": str(server.cert), "key": str(server.key)}
    with GatewayThread(gateway_config(triton.ports.grpc_url, tls=tls)) as gateway:
        yield gateway


@pytest.fixture(scope="module", params=LANGUAGES)
def example(request: pytest.FixtureRequest) -> Example:
    return built(request.param)


def echoed(done: Done) -> list[float]:
    """The values of the example's `infer` line: `OUTPUT0 [1 3]: 1 2.5 -3`."""
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("OUTPUT0 "), line
    return [float(word) for word in line.split(": ", 1)[1].split()]


def counted(done: Done, name: str) -> int:
    match = re.search(rf"\b{name}=(\d+)", done.stderr)
    assert match, f"no {name}= in {done.stderr!r}"
    return int(match[1])


@pytest.mark.parametrize(("language", "line"), example_lines())
def test_readme_example_line(language: str, line: str, gateway: GatewayThread) -> None:
    built(language)
    run = split(shlex.split(line))[1]
    done = bash(line, cwd=ROOT, env=environment(gateway.url, ACME_KEY), timeout=180)
    assert done.returncode == 0, done.stderr
    if run.command == "stream":
        assert "Paris" in done.stdout
        assert counted(done, "parts") > 1  # text came as it was generated
        assert counted(done, "completion_tokens") > 0
    elif run.command == "generate":
        assert done.stdout.strip()
        assert 0 < counted(done, "completion_tokens") <= int(run.flags.get("--max-tokens", "32"))
    elif run.command == "embed":
        vectors = [[float(v) for v in row.split(": ", 1)[1].split()] for row in done.stdout.splitlines()]
        assert [len(v) for v in vectors] == [384] * len(run.operands)
        # The same vectors as the Python client gets: real embeddings, in input order.
        with Client(gateway.url, api_key=ACME_KEY) as python:
            expected = python.embed("minilm", run.operands).embeddings
        for got, want in zip(vectors, expected, strict=True):
            assert got == pytest.approx(list(want.values), abs=1e-5)
    elif run.command == "batch":
        assert re.search(r"^generate-1: .*Paris", done.stdout, re.M), done.stdout
        assert re.search(r"^embed-1: 384 values$", done.stdout, re.M), done.stdout
        assert re.search(r"BATCH_STATUS_COMPLETED succeeded=2 failed=0$", done.stdout, re.M)
    else:
        assert run.command == "infer"
        assert echoed(done) == [float(n) for n in run.operands]


@pytest.mark.parametrize("language", LANGUAGES)
def test_readme_excerpts_are_the_example_source(language: str) -> None:
    excerpts = readme(language).excerpts()
    assert excerpts
    for path, text in excerpts:
        assert text in (ROOT / path).read_text(), f"clients/{language}/README.md quotes {path} wrongly"


@pytest.mark.parametrize("language", LANGUAGES)
def test_readme_walkthrough_streams_from_protos_alone(language: str, gateway: GatewayThread) -> None:
    """The README's program and commands, in a directory with a copy of protos/ and
    nothing else of this repository: what a caller who writes their own client starts
    from. Built once per content of the README's files and build block and of protos/:
    the directory is named by their digest in the user's cache (`paths.user_cache_dir`),
    shared by every checkout of the same text."""
    doc = readme(language)
    prelude = doc.optional("walkthrough", "env")  # what both the build and the run need
    build = prelude + doc.one("walkthrough", "build")
    digest = hashlib.sha256(build.encode())
    for name, text in sorted(doc.files().items()):
        digest.update(name.encode() + text.encode())
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        digest.update(proto.read_bytes())
    work = paths.user_cache_dir() / "walkthrough" / language / digest.hexdigest()[:16]
    work.parent.mkdir(parents=True, exist_ok=True)
    with (work.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another checkout's tests may be building it
        if not (work / ".built").is_file():
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(ROOT / "protos", work / "protos")
            for name, text in doc.files().items():
                (work / name).write_text(text)
            done = bash(build, cwd=work, env=environment("", ""))
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            (work / ".built").touch()
            builds = sorted(work.parent.glob("[0-9a-f]*"), key=lambda path: path.stat().st_mtime)
            for old in builds[:-3]:  # the last three READMEs' builds are kept
                shutil.rmtree(old, ignore_errors=True)
    done = bash(prelude + doc.one("walkthrough", "run"), cwd=work, env=environment(gateway.url, ACME_KEY))
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_wrong_key_reads_unauthenticated_and_is_never_printed(example: Example, gateway: GatewayThread) -> None:
    done = example.run(gateway, "infer", "1", key=WRONG_KEY)
    assert done.returncode == 1
    assert "error: UNAUTHENTICATED: " in done.stderr
    assert WRONG_KEY not in done.stdout + done.stderr


def test_over_quota_reads_retry_info_and_the_retry_waits_it(example: Example, gateway: GatewayThread) -> None:
    key = quota_key(example.language)
    refused = example.run(gateway, "--retries", "0", "--repeat", "2", "infer", "1", key=key)
    assert refused.returncode == 1
    assert refused.stdout.count("OUTPUT0") == 1  # the first call spent the burst
    match = re.search(r"error: RESOURCE_EXHAUSTED: .*\(retry after (\d+\.\d+) s\)", refused.stderr)
    assert match, refused.stderr
    assert 0 < float(match[1]) <= 1 / QUOTA_RATE
    retried = example.run(gateway, "--retries", "3", "--repeat", "2", "infer", "2", key=key)
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.count("OUTPUT0 ") == 2
    waits = [float(w) for w in re.findall(r"retrying in (\d+\.\d+) s after RESOURCE_EXHAUSTED", retried.stderr)]
    assert waits, retried.stderr
    assert all(0 < wait <= 1 / QUOTA_RATE for wait in waits)
    assert retried.elapsed_s >= sum(waits)


def test_tiny_deadline_reads_deadline_exceeded(example: Example, gateway: GatewayThread) -> None:
    done = example.run(gateway, "--deadline-ms", "1", "stream", "Tell me a long story.")
    assert done.returncode == 1
    assert "error: DEADLINE_EXCEEDED: " in done.stderr


def test_class_reaches_the_gateway_in_both_apis(example: Example, gateway: GatewayThread) -> None:
    """globex may use classes up to interactive: critical is refused whether it travels in
    the request (Embed) or in the x-priority header (KServe)."""
    for command in (["embed", "a cat"], ["infer", "1"]):
        allowed = example.run(gateway, "--class", "interactive", *command, key=GLOBEX_KEY)
        assert allowed.returncode == 0, allowed.stderr
        refused = example.run(gateway, "--class", "critical", *command, key=GLOBEX_KEY)
        assert refused.returncode == 1
        assert "error: PERMISSION_DENIED: " in refused.stderr and "critical" in refused.stderr


def test_tls_with_the_test_ca(example: Example, tls_gateway: GatewayThread, pki: Pki) -> None:
    assert echoed(example.run(tls_gateway, "--ca", str(pki.ca.cert), "infer", "4", "5")) == [4.0, 5.0]
    rogue = example.run(tls_gateway, "--retries", "0", "--ca", str(pki.rogue.cert), "infer", "4")
    assert rogue.returncode == 1
    assert "error: UNAVAILABLE: " in rogue.stderr


def test_bad_input_gets_a_clear_error(example: Example, gateway: GatewayThread) -> None:
    for args, says in (
        (["infer", "x"], "infer takes numbers"),
        (["bogus"], "unknown command"),
        (["--retries", "x", "infer", "1"], "retries"),
        (["--ca", "/nonexistent/ca.pem", "infer", "1"], "/nonexistent/ca.pem"),
    ):
        done = example.run(gateway, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert says in done.stderr, (args, done.stderr)
    done = example.run(gateway, "infer", "1", key="")
    assert done.returncode == 2
    assert re.search(r"API ?key is empty", done.stderr, re.I), done.stderr
