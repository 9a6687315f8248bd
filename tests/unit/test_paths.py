"""Where the gateway keeps its state: a checkout's .cache/, an installed copy's user data
directory (its project root is the Python library directory, not writable), or the
config's `state_dir`; every SQLite file defaults to it."""

from __future__ import annotations

import pathlib

import pytest
from qosgate import paths
from qosgate.cli import main
from qosgate.config import parse_config


def test_a_checkout_keeps_its_state_in_its_cache() -> None:
    assert paths.is_checkout()
    assert paths.default_state_dir() == paths.project_root() / ".cache"


def test_an_installed_copy_keeps_its_state_in_the_users_data_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "lib" / "python3.11"  # what project_root() is for an installed copy
    site.mkdir(parents=True)
    monkeypatch.setenv("QOSGATE_HOME", str(site))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert not paths.is_checkout()
    assert paths.default_state_dir() == tmp_path / "home" / ".local" / "share" / "qosgate"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert paths.default_state_dir() == tmp_path / "data" / "qosgate"


def test_state_dir_in_the_config_wins() -> None:
    assert parse_config({"state_dir": "/var/lib/qosgate"}).state_directory() == pathlib.Path("/var/lib/qosgate")
    assert parse_config({}).state_directory() == paths.default_state_dir()


def test_a_state_dir_that_cannot_be_made_is_a_clear_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = tmp_path / "gateway.yaml"
    config.write_text(f"state_dir: {blocker}/state\nlisten: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"state_dir {blocker}/state: cannot create it: Not a directory; "
        "set `state_dir` to a directory this user may write\n"
    )
