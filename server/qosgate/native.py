"""The gateway's per-call path, compiled to C by mypyc at setup (`make native`).

The modules below are what every relayed call runs through: the HTTP/2 transport and
relay, the KServe handlers, the data plane's call scope, the scheduler, quotas and
tenants, and the status a refusal is answered with; and the tensors of every streamed
generation's responses (the vLLM adapter), decoded once per token. mypyc compiles
them from their typed Python source (no other source exists) into extension modules next
to it, which Python imports in preference to the `.py` files; the work per call is the
same, its interpreter overhead is not (about a fifth less CPU per forwarded call, see
docs/performance.md).

Compiled code checks its annotations at run time: a value of another type than annotated
raises TypeError where interpreted code would carry on. And it does not await inside a
`finally` block: mypyc 2.4 re-raised an exception being handled after such an await.

A compiled module built from other source than the one beside it would run old code, so
importing `qosgate` fails with the command to run (`stale()`). The build records the
SHA-256 of each module's source in `native.sha256` (sha256sum's format) and the check
compares contents, not file times, which an install or a checkout does not keep. Without
the compiled modules (an install that skipped `make native`) the same source runs
interpreted, and `qosgate serve` says so at start.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent

# Paths relative to the package. The shared library mypyc builds for them is GROUP.
MODULES = (
    "adapters/tensors.py",
    "adapters/vllm.py",
    "auth.py",
    "clock.py",
    "eager.py",
    "edge.py",
    "memory.py",
    "metrics.py",
    "dataplane/call.py",
    "dataplane/plane.py",
    "dataplane/tracing.py",
    "error_table.py",
    "kserve/wire.py",
    "quota/admission.py",
    "quota/bucket.py",
    "quota/store.py",
    "quota/tokens.py",
    "quota/verdict.py",
    "relay/infer_policy.py",
    "relay/messages.py",
    "relay/policy.py",
    "relay/server.py",
    "relay/stream_infer.py",
    "scheduler/aio.py",
    "scheduler/classes.py",
    "scheduler/core.py",
    "scheduler/cost.py",
    "scheduler/window.py",
    "transport/framing.py",
    "transport/http2.py",
    "transport/messages.py",
    "transport/peer.py",
    "transport/status.py",
    "upstream/connections.py",
    "upstream/pool.py",
    "upstream/routing.py",
)
GROUP = "qosgate._native"
# The SHA-256 of each module's source as compiled, written by scripts/build_native.py.
RECORD = "native.sha256"


def built(source: pathlib.Path) -> list[pathlib.Path]:
    """The extension modules compiled from `source` (none if not built)."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    candidates = (source.with_name(source.stem + suffix) for suffix in suffixes)
    return [path for path in candidates if path.exists()]


def compiled(package: pathlib.Path = PACKAGE) -> bool:
    """Whether every module of the list has its extension module."""
    return all(built(package / name) for name in MODULES)


def source_digest(source: pathlib.Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def recorded(package: pathlib.Path = PACKAGE) -> dict[str, str]:
    """Module (path relative to the package) -> the SHA-256 its extension module was built
    from; empty when nothing was recorded."""
    try:
        lines = (package / RECORD).read_text().splitlines()
    except FileNotFoundError:
        return {}
    return {name: digest for digest, _, name in (line.partition("  ") for line in lines) if name}


def stale(package: pathlib.Path = PACKAGE) -> list[str]:
    """Modules whose extension module was built from other source than theirs now."""
    record = recorded(package)
    return [
        name
        for name in MODULES
        if built(package / name) and record.get(name) != source_digest(package / name)
    ]
