"""The gateway's per-call path, compiled to C by mypyc at setup (`make native`).

The modules below are what every relayed call runs through: the HTTP/2 relay, the KServe
handlers, the data plane's call scope, the scheduler, quotas and tenants, and the status
details a refusal is answered with. mypyc compiles
them from their typed Python source (no other source exists) into extension modules next
to it, which Python imports in preference to the `.py` files; the work per call is the
same, its interpreter overhead is not (about a fifth less CPU per forwarded call, see
docs/performance.md).

Compiled code checks its annotations at run time: a value of another type than annotated
raises TypeError where interpreted code would carry on. And it does not await inside a
`finally` block: mypyc 2.4 re-raised an exception being handled after such an await.

A compiled module older than its source would run old code, so importing `qosgate` fails
with the command to run (`stale()`). Without the compiled modules (an install that skipped
`make native`) the same source runs interpreted, and `qosgate serve` says so at start.
"""

from __future__ import annotations

import importlib.machinery
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent

# Paths relative to the package. The shared library mypyc builds for them is GROUP.
MODULES = (
    "auth.py",
    "clock.py",
    "eager.py",
    "memory.py",
    "metrics.py",
    "dataplane/plane.py",
    "dataplane/tracing.py",
    "quota/admission.py",
    "quota/bucket.py",
    "quota/store.py",
    "quota/tokens.py",
    "quota/verdict.py",
    "relay/framing.py",
    "relay/http2.py",
    "relay/infer_policy.py",
    "relay/messages.py",
    "relay/peer.py",
    "relay/policy.py",
    "relay/server.py",
    "relay/stream_infer.py",
    "relay/upstream.py",
    "scheduler/aio.py",
    "scheduler/classes.py",
    "scheduler/core.py",
    "scheduler/cost.py",
    "scheduler/window.py",
    "services/infer_wire.py",
    "services/status.py",
)
GROUP = "qosgate._native"


def built(source: pathlib.Path) -> list[pathlib.Path]:
    """The extension modules compiled from `source` (none if not built)."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    candidates = (source.with_name(source.stem + suffix) for suffix in suffixes)
    return [path for path in candidates if path.exists()]


def compiled(package: pathlib.Path = PACKAGE) -> bool:
    """Whether every module of the list has its extension module."""
    return all(built(package / name) for name in MODULES)


def stale(package: pathlib.Path = PACKAGE) -> list[str]:
    """Modules whose extension module is older than their source."""
    out = []
    for name in MODULES:
        source = package / name
        mtime = source.stat().st_mtime
        if any(ext.stat().st_mtime < mtime for ext in built(source)):
            out.append(name)
    return out
