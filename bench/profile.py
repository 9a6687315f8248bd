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
            # py-spy names a frame `function (file:line)`; a function counts once, whatever line.
            frames = [_LINE.sub(")", f) for f in stack.split(";")]
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
    """Sample `pid` (and its threads) without pausing it for `seconds`; raw stacks go to `out`."""
    tool = py_spy()
    if tool is None:
        raise FileNotFoundError("py-spy is not installed: pip install -e '.[bench]'")
    subprocess.run(
        [str(tool), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--nonblocking",
         "--format", "raw", "--output", str(out)],
        check=True, capture_output=True, timeout=seconds + 60,
    )
    stacks: dict[str, int] = {}
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            stacks[stack] = stacks.get(stack, 0) + int(count)
    return Profile(stacks)
