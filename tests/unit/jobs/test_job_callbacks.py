"""The callback allowlist matches scheme, host, port and a path prefix at a `/` boundary."""

from __future__ import annotations

import pytest
from qosgate.errors import InvalidArgument
from qosgate.jobs.callbacks import CallbackPolicy

POLICY = CallbackPolicy(["https://hooks.example.com/qosgate/", "http://127.0.0.1:8080"])


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/qosgate/",
        "https://hooks.example.com/qosgate/job-done?x=1",
        "https://HOOKS.example.com/qosgate/a/b",
        "http://127.0.0.1:8080/anything",
    ],
)
def test_allowed(url: str) -> None:
    POLICY.check(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://hooks.example.com/qosgate/x",  # scheme differs
        "https://hooks.example.com/qosgatex/x",  # prefix without a / boundary
        "https://hooks.example.com.evil.net/qosgate/x",  # host suffix trick
        "https://hooks.example.com:444/qosgate/x",  # port differs
        "http://127.0.0.1:8001/",  # Triton's port on the same host
        "ftp://127.0.0.1:8080/x",
        "not a url",
    ],
)
def test_refused(url: str) -> None:
    with pytest.raises(InvalidArgument):
        POLICY.check(url)


def test_empty_allowlist_refuses_everything() -> None:
    with pytest.raises(InvalidArgument, match="allowlist"):
        CallbackPolicy([]).check("https://hooks.example.com/qosgate/")
