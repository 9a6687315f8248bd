"""Reading a batch job's input file: JSON Lines, one qosgate.v1.BatchItem per line.

Each line is a BatchItem in proto3 JSON form, e.g.
  {"custom_id": "q1", "generate": {"prompt": "Hello", "sampling": {"max_tokens": 16}}}
  {"custom_id": "e1", "embed": {"model": "minilm", "inputs": ["a sentence"]}}
so the file format is the API's own message and needs no separate schema. The whole file
is checked before anything is sent: one bad line means nothing is queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format
from qosgate.v1 import batch_pb2


@dataclass(frozen=True, slots=True)
class LineProblem:
    """Why one line of the input file is not a valid item."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class BatchFileError(Exception):
    """The input file has invalid lines; `problems` lists each with its line number."""

    def __init__(self, path: Path, problems: list[LineProblem]) -> None:
        shown = "\n".join(f"  {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(
            f"{path}: {len(problems)} invalid line(s), nothing was submitted:\n{shown}{more}"
        )
        self.problems = problems


def _parse(text: str) -> batch_pb2.BatchItem:
    item = batch_pb2.BatchItem()
    json_format.Parse(text, item)
    if not item.custom_id:
        raise ValueError("custom_id is missing or empty")
    if item.WhichOneof("request") is None:
        raise ValueError('one of "generate" or "embed" is required')
    return item


def _items_with_lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                yield number, text


def check_batch_file(path: Path) -> int:
    """Validates every line (without keeping them); returns the item count or raises
    BatchFileError naming each bad line."""
    problems: list[LineProblem] = []
    first_line_of: dict[str, int] = {}
    count = 0
    for number, text in _items_with_lines(path):
        try:
            item = _parse(text)
        except (json_format.ParseError, ValueError) as error:
            problems.append(LineProblem(number, str(error)))
            continue
        if item.custom_id in first_line_of:
            problems.append(
                LineProblem(
                    number,
                    f"custom_id {item.custom_id!r} already used on line "
                    f"{first_line_of[item.custom_id]}",
                )
            )
            continue
        first_line_of[item.custom_id] = number
        count += 1
    if problems:
        raise BatchFileError(path, problems)
    if count == 0:
        raise BatchFileError(path, [LineProblem(0, "the file has no items")])
    return count


def read_batch_items(path: Path) -> Iterator[batch_pb2.BatchItem]:
    """The items of a file that check_batch_file accepted, read lazily."""
    for _, text in _items_with_lines(path):
        yield _parse(text)
