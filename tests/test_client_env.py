"""``Client.from_env()`` and ``read_token_file``: ORBIT_* settings, the token never echoed."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbit_sync import Client, Worker
from orbit_sync.client import HANDLER_PROCESS_ENV, SettingError, queue_id_from_env, read_token_file

TOKEN = "env-token-0123456789"


def test_url_and_token_from_the_environment() -> None:
    """ORBIT_URL and ORBIT_TOKEN make the client; its repr hides the token."""
    client = Client.from_env({"ORBIT_URL": "ws://127.0.0.1:8765/", "ORBIT_TOKEN": TOKEN})
    assert client.base_url == "ws://127.0.0.1:8765"
    assert TOKEN not in repr(client)


def test_token_from_a_file(tmp_path: Path) -> None:
    """ORBIT_TOKEN_FILE names a file whose stripped content is the token."""
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    client = Client.from_env(
        {"ORBIT_URL": "wss://orbit.example.com", "ORBIT_TOKEN_FILE": str(path)}
    )
    assert client.base_url == "wss://orbit.example.com"
    assert read_token_file(path) == TOKEN


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ORBIT_TOKEN": TOKEN}, "ORBIT_URL is not set"),
        ({"ORBIT_URL": "ws://h"}, "ORBIT_TOKEN (or ORBIT_TOKEN_FILE) is not set"),
        (
            {"ORBIT_URL": "ws://h", "ORBIT_TOKEN": TOKEN, "ORBIT_TOKEN_FILE": "/x"},
            "set only one of ORBIT_TOKEN and ORBIT_TOKEN_FILE",
        ),
        ({"ORBIT_URL": "http://h", "ORBIT_TOKEN": TOKEN}, "ws:// or wss://"),
        ({"ORBIT_URL": "ws://h", "ORBIT_TOKEN": f"{TOKEN} x"}, "bearer token"),
        ({"ORBIT_URL": "ws://h", "ORBIT_TOKEN_FILE": "/nonexistent"}, "/nonexistent"),
        ({"ORBIT_URI": "ws://h", "ORBIT_TOKEN": TOKEN}, "(ORBIT_URI is set: a misspelling?)"),
        ({"ORBIT_URL": "ws://h", "ORBIT_TOKN": TOKEN}, "(ORBIT_TOKN is set: a misspelling?)"),
        ({"ORBIT_URL": "ws://", "ORBIT_TOKEN": TOKEN}, "ORBIT_URL needs a host"),
    ],
)
def test_missing_or_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    """Each missing or bad setting raises SettingError (a ValueError) naming it, and its likely
    misspelling, never repeating the token."""
    with pytest.raises(SettingError) as info:
        Client.from_env(env)
    assert message in str(info.value)
    assert TOKEN not in str(info.value)


def test_a_file_that_holds_no_token_is_refused_without_echo(tmp_path: Path) -> None:
    """Content that is not one bearer token (empty, words, binary) is refused; never shown."""
    path = tmp_path / "token"
    for content in (b"", b"two words-0123", b"\xff\xfe secret"):
        path.write_bytes(content)
        with pytest.raises(ValueError) as info:
            read_token_file(path)
        assert str(path) in str(info.value)
        assert "words" not in str(info.value) and "secret" not in str(info.value)


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an argument, os.environ is read."""
    monkeypatch.setenv("ORBIT_URL", "ws://127.0.0.1:1")
    monkeypatch.setenv("ORBIT_TOKEN", TOKEN)
    monkeypatch.delenv("ORBIT_TOKEN_FILE", raising=False)
    assert Client.from_env().base_url == "ws://127.0.0.1:1"


def test_other_orbit_variables_are_not_taken_for_misspellings() -> None:
    """Only a name at most two letters off is a misspelling: the mock server's ORBIT_MOCK_TOKEN
    or an ORBIT_TEST_TOKEN beside a missing ORBIT_TOKEN is just a missing setting."""
    for other in ("ORBIT_MOCK_TOKEN", "ORBIT_TEST_TOKEN", "ORBIT_ADMIN_TOKEN"):
        with pytest.raises(SettingError) as info:
            Client.from_env({"ORBIT_URL": "ws://h", other: TOKEN})
        assert str(info.value) == "ORBIT_TOKEN (or ORBIT_TOKEN_FILE) is not set"


def test_a_handler_process_gets_a_client_without_the_token() -> None:
    """In a process-executor child (marked in its environment) from_env neither needs nor reads
    a token: the module that builds the Worker imports, and no secret enters the child."""
    client = Client.from_env(
        {"ORBIT_URL": "ws://h", "ORBIT_TOKEN_FILE": "/nonexistent", HANDLER_PROCESS_ENV: "1"}
    )
    assert client.base_url == "ws://h"
    with pytest.raises(SettingError, match="ORBIT_TOKEN"):
        Client.from_env({"ORBIT_URL": "ws://h", HANDLER_PROCESS_ENV: "0"})


QUEUE = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "no queue_id given and ORBIT_QUEUE_ID is not set"),
        (
            {"ORBIT_QUEUEID": QUEUE},
            "no queue_id given and ORBIT_QUEUE_ID is not set"
            " (ORBIT_QUEUEID is set: a misspelling?)",
        ),
        ({"ORBIT_QUEUE_ID": "q1"}, "ORBIT_QUEUE_ID must be 32 lowercase hex characters"),
    ],
)
def test_a_worker_without_queue_id_names_the_missing_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    """Worker(client) without queue_id and without a usable $ORBIT_QUEUE_ID raises a
    SettingError naming the variable, before anything is started."""
    for name in ("ORBIT_QUEUE_ID", "ORBIT_QUEUEID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = Client.from_env({"ORBIT_URL": "ws://127.0.0.1:9", "ORBIT_TOKEN": TOKEN})
    with pytest.raises(SettingError) as caught:
        Worker(client)
    assert str(caught.value) == message


def test_a_worker_without_queue_id_serves_orbit_queue_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker(client) takes its queue from $ORBIT_QUEUE_ID, and its options name that queue."""
    monkeypatch.setenv("ORBIT_QUEUE_ID", QUEUE)
    worker = Worker(Client.from_env({"ORBIT_URL": "ws://127.0.0.1:9", "ORBIT_TOKEN": TOKEN}))
    worker.register("echo", lambda ctx, payload: payload)
    assert worker.registration.queue_id == QUEUE
    assert worker.options.queue_id == QUEUE
    assert queue_id_from_env({"ORBIT_QUEUE_ID": QUEUE}) == QUEUE
