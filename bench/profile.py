"""Where a process spends its CPU: py-spy samples (collapsed stacks) summed per function."""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re
import shutil
import subprocess
import sys


_LINE = re.compile(r":\d+\)$")
# A function mypyc compiled, as py-spy's native unwinding names it (its C wrapper CPyPy_
# and body CPyDef_ alike): `CPyDef_qosgate___transport___peer___Peer___data_received
# (__native__native.c:216685)`.
_COMPILED = re.compile(r"^CPy(?:Def|Py)_qosgate___(\w+) \(__native__native\.c:\d+\)$")
# A stack ending here is a thread waiting for I/O (the event loop's selector), not CPU.
_WAITING = frozenset({"epoll_wait", "epoll_pwait", "poll", "select"})


def _function(frame: str) -> str:
    """A frame as the tables name it: `function (file)` whatever the line; a compiled
    function `package.module.Class.method (qosgate/, compiled)`."""
    compiled = _COMPILED.match(frame)
    if compiled:
        return f"{compiled.group(1).replace('___', '.')} (qosgate/, compiled)"
    return _LINE.sub(")", frame)


@dataclasses.dataclass(slots=True)
class Profile:
    """Sample counts per collapsed stack, as py-spy's raw format writes them."""

    stacks: dict[str, int]

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())

    def top(self, count: int, *, inclusive: bool, within: str = "") -> list[dict[str, object]]:
        """Functions by share of samples: where the CPU is (self), or under them (inclusive).

        `within` keeps only frames whose location contains it (e.g. "qosgate/"): inclusive
        shares of the event loop's own frames say nothing about the code it runs.
        """
        totals: collections.Counter[str] = collections.Counter()
        for stack, n in self.stacks.items():
            frames = [_function(f) for f in stack.split(";")]
            for frame in set(frames) if inclusive else frames[-1:]:
                if within in frame:
                    totals[frame] += n
        total = self.samples or 1
        return [{"function": frame, "share %": round(100 * n / total, 1)} for frame, n in totals.most_common(count)]


    def tables(self) -> dict[str, list[dict[str, object]]]:
        """The report's two views of a gateway profile."""
        return {
            "gateway profile, self time": self.top(12, inclusive=False),
            "gateway profile, inclusive, qosgate code": self.top(12, inclusive=True, within="qosgate/"),
        }


def py_spy() -> pathlib.Path | None:
    found = pathlib.Path(sys.executable).with_name("py-spy")
    return found if found.exists() else (pathlib.Path(p) if (p := shutil.which("py-spy")) else None)


def record(pid: int, seconds: float, out: pathlib.Path) -> Profile:
    """Sample `pid` (and its threads) for `seconds`, native frames included (the compiled
    modules are C to py-spy: without them every sample ends in the event loop), pausing it
    for each sample; raw stacks go to `out`. Samples of a thread waiting for I/O are left
    out (`parse`): the shares are of the CPU the process spends."""
    tool = py_spy()
    if tool is None:
        raise FileNotFoundError("py-spy is not installed: pip install -e '.[bench]'")
    subprocess.run(
        [str(tool), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--native",
         "--format", "raw", "--output", str(out)],
        check=True, capture_output=True, timeout=seconds + 60,
    )
    return parse(out.read_text())


def parse(raw: str) -> Profile:
    """py-spy's raw format (a collapsed stack and its count per line), less the samples
    of threads waiting for I/O."""
    stacks: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and stack.rpartition(";")[2].partition(" ")[0] not in _WAITING:
            stacks[stack] = stacks.get(stack, 0) + int(count)
    return Profile(stacks)
