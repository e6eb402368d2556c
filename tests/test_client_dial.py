"""Client and dial_worker over loopback: upgrade request, refusals, redirects, hello/welcome."""

from __future__ import annotations

import json
import ssl
import threading
import time
from typing import Any

import pytest
from _scripted import (
    QUEUE_ID,
    SESSION_ID,
    TOKEN,
    WAIT,
    ScriptedServer,
    SilentServer,
    frame,
    iter_vectors,
    open_pair,
    orbit_threads,
    registration,
    welcome_body,
)

from orbit_sync.client import DIAL_TIMEOUT, Client, DialCut
from orbit_sync.errors import (
    CallTimeout,
    HTTPError,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)


def _dial_in_thread(url: str, **dial: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start dial_worker on a thread; the result dict gets 'conn' or 'error'."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["conn"] = Client(url, TOKEN).dial_worker(registration(), **dial)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name="test-dial", daemon=True)
    thread.start()
    return thread, out


def test_upgrade_request_carries_bearer_token_and_subprotocol() -> None:
    """The upgrade is GET /v1/worker/connect with the bearer token, our subprotocol, no query,
    no compression offer and no Origin."""
    with ScriptedServer() as server:
        conn, _peer = open_pair(server)
        try:
            path, headers = server.requests[0]
            assert path == "/v1/worker/connect"
            auth_ok = headers.get("Authorization") == f"Bearer {TOKEN}"
            assert auth_ok, "Authorization header is not the bearer token"
            assert headers.get("Sec-WebSocket-Protocol") == "pulse.worker.v1"
            assert "Sec-WebSocket-Extensions" not in headers
            assert "Origin" not in headers
        finally:
            conn.close()


def test_base_url_path_prefix_is_kept() -> None:
    """A base URL with a path prefix dials {prefix}/v1/worker/connect."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url + "/orbit/", timeout=0.5)
        peer = server.accept()
        peer.close()
        thread.join(WAIT)
        assert server.requests[0][0] == "/orbit/v1/worker/connect"
        assert "conn" not in out


def test_hello_frame_and_welcome_are_exposed() -> None:
    """The hello carries the registration and no session id; the welcome is exposed as-is."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url)
        peer = server.accept()
        hello = peer.recv()
        peer.welcome(hello, epoch="7", lease_duration_ms=20_000)
        thread.join(WAIT)
        conn = out["conn"]
        try:
            assert set(hello) == {"protocol_version", "type", "message_id", "body"}
            assert hello["type"] == "worker.hello"
            assert hello["body"]["queue_id"] == QUEUE_ID
            assert hello["body"]["capabilities"] == [
                {"handler": "resize", "handler_version": "1", "payload_version": "1"}
            ]
            assert hello["body"]["capacity"] == 4
            assert conn.session_id == SESSION_ID
            assert conn.welcome.epoch == 7
            assert conn.welcome.lease_duration_ms == 20_000
            assert conn.registration == registration()
            assert conn.err is None and not conn.done.is_set()
        finally:
            conn.close()


@pytest.mark.parametrize("status", [400, 401, 403, 404, 500, 503])
def test_refused_upgrade_raises_http_error(status: int) -> None:
    """A non-101 answer to the upgrade raises HTTPError with that status code."""
    with ScriptedServer(status=status) as server:
        with pytest.raises(HTTPError) as caught:
            Client(server.url, TOKEN).dial_worker(registration())
        assert caught.value.status_code == status


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_redirect_is_reported_and_never_followed(status: int) -> None:
    """A redirect raises HTTPError(3xx); the target never sees a request (nor the token)."""
    with ScriptedServer() as target:
        with ScriptedServer(status=status, location=target.url + "/v1/worker/connect") as server:
            with pytest.raises(HTTPError) as caught:
                Client(server.url, TOKEN).dial_worker(registration())
            assert caught.value.status_code == status
        assert target.requests == []


@pytest.mark.parametrize("answered", [None, "other.v1", "PULSE.WORKER.V1"])
def test_subprotocol_must_be_selected(answered: str | None) -> None:
    """An upgrade answered without pulse.worker.v1 (exactly) is a protocol error."""
    with ScriptedServer(subprotocol=answered) as server:
        thread, out = _dial_in_thread(server.url)
        thread.join(WAIT)
        assert isinstance(out.get("error"), WorkerProtocolError)


@pytest.mark.parametrize(
    ("code", "with_session"),
    [
        ("UNAUTHENTICATED", False),
        ("PERMISSION_DENIED", True),
        ("RATE_LIMITED", False),
        ("SOME_NEW_CODE", True),
    ],
)
def test_hello_answered_with_error_raises_worker_error(code: str, with_session: bool) -> None:
    """An error answering the hello raises WorkerError with its code (session id optional)."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url)
        peer = server.accept()
        hello = peer.recv()
        session = SESSION_ID if with_session else None
        peer.send(
            frame("error", reply_to=hello["message_id"], session_id=session, error=(code, "x"))
        )
        thread.join(WAIT)
        err = out.get("error")
        assert isinstance(err, WorkerError)
        assert err.code == code


WELCOMES = list(iter_vectors("welcome_answering_pending_hello"))


@pytest.mark.parametrize("vector", WELCOMES, ids=[v["name"] for v in WELCOMES])
def test_welcome_vectors_over_the_wire(vector: dict[str, Any]) -> None:
    """Each welcome vector, sent as the answer to the real hello, is accepted or refused."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url)
        peer = server.accept()
        hello = peer.recv()
        peer.send(vector["frame"].replace("4" * 32, hello["message_id"]))
        thread.join(WAIT)
        if vector["valid"]:
            conn = out["conn"]
            assert conn.session_id == SESSION_ID
            conn.close()
        else:
            assert isinstance(out.get("error"), WorkerProtocolError)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda hello: frame("worker.welcome", reply_to="9" * 32, body=welcome_body()),
            id="reply-to-other-id",
        ),
        pytest.param(
            lambda hello: frame("ack", reply_to=hello["message_id"], body=welcome_body()),
            id="ack-instead-of-welcome",
        ),
        pytest.param(
            lambda hello: frame("worker.welcome", body=welcome_body()),
            id="welcome-without-reply-to",
        ),
        pytest.param(
            lambda hello: frame(
                "worker.welcome",
                reply_to=hello["message_id"],
                session_id="9" * 32,
                body=welcome_body(),
            ),
            id="frame-session-differs",
        ),
        pytest.param(
            lambda hello: frame(
                "worker.welcome",
                reply_to=hello["message_id"],
                body=welcome_body(window=301),
            ),
            id="session-window-over-5-min",
        ),
    ],
)
def test_invalid_welcome_is_a_protocol_error(make: Any) -> None:
    """A first frame that is not a valid welcome for this hello fails the dial."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url)
        peer = server.accept()
        peer.send(make(peer.recv()))
        thread.join(WAIT)
        assert isinstance(out.get("error"), WorkerProtocolError)
    assert orbit_threads() == []


def test_binary_welcome_is_a_protocol_error() -> None:
    """A binary frame answering the hello fails the dial with a protocol error."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url)
        peer = server.accept()
        hello = peer.recv()
        body = frame("worker.welcome", reply_to=hello["message_id"], body=welcome_body())
        peer.conn.send(json.dumps(body).encode(), text=False)
        thread.join(WAIT)
        assert isinstance(out.get("error"), WorkerProtocolError)


def test_dial_times_out_when_upgrade_is_never_answered() -> None:
    """A server that accepts TCP but never answers the upgrade trips the dial's bound."""
    with SilentServer() as silent:
        started = time.monotonic()
        with pytest.raises(CallTimeout):
            Client(silent.url, TOKEN).dial_worker(registration(), timeout=0.3)
        assert time.monotonic() - started < 2.0
        assert silent.accepted.is_set()
    assert orbit_threads() == []


def test_dial_times_out_when_welcome_never_comes() -> None:
    """An upgraded connection whose hello is never answered trips the same bound."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url, timeout=0.3)
        peer = server.accept()
        peer.recv()  # the hello, left unanswered
        thread.join(WAIT)
        assert isinstance(out.get("error"), CallTimeout)
        assert peer.wait_closed()


def test_dial_timeout_is_capped_at_eight_seconds() -> None:
    """A dial given 30 s runs under the protocol's 8 s bound (its timeout names the bound it
    ran with); a shorter timeout is kept."""
    assert DIAL_TIMEOUT == 8.0
    with SilentServer() as silent:
        cut = DialCut()
        thread, out = _dial_in_thread(silent.url, timeout=30.0, cut=cut)
        assert silent.accepted.wait(WAIT)
        cut.cut()
        thread.join(WAIT)
        assert str(out["error"]) == "dial did not complete within 8 s"
        with pytest.raises(CallTimeout, match=r"^dial did not complete within 0\.25 s$"):
            Client(silent.url, TOKEN).dial_worker(registration(), timeout=0.25)


def test_server_closing_before_welcome_is_a_disconnect() -> None:
    """The server closing the WebSocket instead of answering the hello raises WorkerDisconnected."""
    with ScriptedServer() as server:
        thread, out = _dial_in_thread(server.url)
        peer = server.accept()
        peer.recv()
        peer.conn.close()
        thread.join(WAIT)
        assert isinstance(out.get("error"), WorkerDisconnected)


def test_connection_refused_is_a_disconnect() -> None:
    """Nothing listening on the port raises WorkerDisconnected."""
    with SilentServer() as silent:
        url = silent.url
    with pytest.raises(WorkerDisconnected):
        Client(url, TOKEN).dial_worker(registration(), timeout=2.0)


def test_proxy_environment_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """http_proxy/https_proxy are not consulted: the dial goes straight to the server."""
    with SilentServer() as proxy, ScriptedServer() as server:
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        conn, _peer = open_pair(server)
        conn.close()
        assert not proxy.accepted.is_set()


@pytest.mark.parametrize(
    ("url", "token", "error"),
    [
        ("http://127.0.0.1:1", TOKEN, ValueError),
        ("ws://127.0.0.1:1/?token=x", TOKEN, ValueError),
        ("ws://127.0.0.1:1/?", TOKEN, ValueError),
        ("ws://127.0.0.1:1/#frag", TOKEN, ValueError),
        ("ws://user:pw@127.0.0.1:1", TOKEN, ValueError),
        ("ws:///nohost", TOKEN, ValueError),
        ("ws://127.0.0.1:99999", TOKEN, ValueError),
        ("ws://127.0.0.1:1", "", ValueError),
        ("ws://127.0.0.1:1", "abc\r\nX-Injected: 1", ValueError),
        ("ws://127.0.0.1:1", "two words", ValueError),
        (b"ws://127.0.0.1:1", TOKEN, TypeError),
        ("ws://127.0.0.1:1", None, TypeError),
    ],
)
def test_client_rejects_bad_arguments(url: Any, token: Any, error: type[Exception]) -> None:
    """Bad base URLs and tokens are refused at construction, without echoing the token."""
    with pytest.raises(error) as caught:
        Client(url, token)
    if isinstance(token, str) and token:
        assert token not in str(caught.value)


def test_ssl_context_rules() -> None:
    """ssl_context is for wss:// only and must verify certificates and host names."""
    with pytest.raises(ValueError):
        Client("ws://127.0.0.1:1", TOKEN, ssl_context=ssl.create_default_context())
    no_hostname = ssl.create_default_context()
    no_hostname.check_hostname = False
    with pytest.raises(ValueError):
        Client("wss://localhost:1", TOKEN, ssl_context=no_hostname)
    no_verify = ssl.create_default_context()
    no_verify.check_hostname = False
    no_verify.verify_mode = ssl.CERT_NONE
    with pytest.raises(ValueError):
        Client("wss://localhost:1", TOKEN, ssl_context=no_verify)
    with pytest.raises(TypeError):
        Client("wss://localhost:1", TOKEN, ssl_context=object())  # type: ignore[arg-type]


def test_client_repr_redacts_token() -> None:
    """The client's repr and str show the URL, never the token."""
    client = Client("ws://127.0.0.1:1/x", TOKEN)
    assert TOKEN not in repr(client) and TOKEN not in str(client)
    assert "127.0.0.1:1/x" in repr(client)
    assert client.base_url == "ws://127.0.0.1:1/x"


def test_dial_arguments_are_checked_before_connecting() -> None:
    """Invalid dial arguments raise before any connection is attempted."""
    with SilentServer() as silent:
        client = Client(silent.url, TOKEN)
        with pytest.raises(ValueError):
            client.dial_worker(registration(), on_cancel=lambda notice: None)
        with pytest.raises(TypeError):
            client.dial_worker("not a registration")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            client.dial_worker(registration(), timeout=0)
        with pytest.raises(TypeError):
            client.dial_worker(registration(), timeout=True)
        with pytest.raises(ValueError):
            client.dial_worker(registration(), max_call_timeout=float("nan"))
        assert not silent.accepted.is_set()
