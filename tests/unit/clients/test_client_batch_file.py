"""The batch input file is checked whole: every bad line is named, nothing half-read."""

from __future__ import annotations

from pathlib import Path

import pytest
from qosgate_client.batch_file import BatchFileError, check_batch_file, read_batch_items

GOOD = [
    '{"custom_id": "q1", "generate": {"prompt": "Hello", "sampling": {"max_tokens": 8}}}',
    (
        '{"custom_id": "q2", "generate": {"model": "smollm2", "chat": {"messages": '
        '[{"role": "ROLE_USER", "content": "Hi"}]}}}'
    ),
    "",
    '{"custom_id": "e1", "embed": {"model": "minilm", "inputs": ["a", "b"]}}',
]


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_valid_file_counts_items_and_reads_them_back(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    assert check_batch_file(path) == 3
    items = list(read_batch_items(path))
    assert [i.custom_id for i in items] == ["q1", "q2", "e1"]
    assert items[0].generate.sampling.max_tokens == 8
    assert items[1].generate.chat.messages[0].content == "Hi"
    assert list(items[2].embed.inputs) == ["a", "b"]


def test_every_bad_line_is_reported_with_its_number(tmp_path: Path) -> None:
    lines = [
        GOOD[0],
        "{not json",
        '{"custom_id": "x", "generate": {"prompt": "a", "no_such_field": 1}}',
        '{"custom_id": "", "generate": {"prompt": "a"}}',
        '{"custom_id": "y"}',
        '{"custom_id": "q1", "generate": {"prompt": "again"}}',
    ]
    with pytest.raises(BatchFileError) as caught:
        check_batch_file(write(tmp_path, lines))
    problems = caught.value.problems
    assert [p.line for p in problems] == [2, 3, 4, 5, 6]
    assert "no_such_field" in problems[1].reason
    assert "custom_id" in problems[2].reason
    assert "generate" in problems[3].reason
    assert "line 1" in problems[4].reason
    assert "nothing was submitted" in str(caught.value)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError):
        check_batch_file(write(tmp_path, ["", "  "]))
