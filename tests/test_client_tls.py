"""wss:// with trustme certificates: verification always on, and concurrent calls over TLS."""

from __future__ import annotations

import datetime
import socket
import ssl
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from _scripted import (
    LEASE_SECRET,
    TOKEN,
    WAIT,
    ScriptedServer,
    assignment_body,
    command_body,
    open_pair,
    orbit_threads,
    registration,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from orbit_sync.client import Client
from orbit_sync.errors import WorkerDisconnected
from orbit_sync.models import AttemptRef, CommandResult

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A throwaway certificate authority."""
    return trustme.CA()


def _server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


@pytest.fixture
def trusting(ca: trustme.CA) -> ssl.SSLContext:
    """A client context that trusts the throwaway CA (and verifies host names)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@pytest.fixture
def tls_server(ca: trustme.CA) -> Iterator[ScriptedServer]:
    """A scripted wss:// server with a certificate for localhost."""
    with ScriptedServer(ssl_context=_server_context(ca, "localhost")) as server:
        yield server


def test_wss_dial_and_call(tls_server: ScriptedServer, trusting: ssl.SSLContext) -> None:
    """A wss:// dial with a trusting context works end to end."""
    assert tls_server.url.startswith("wss://localhost:")
    conn, peer = open_pair(tls_server, ssl_context=trusting)
    try:
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.update(r=conn.start(REF)), daemon=True)
        thread.start()
        peer.ack(peer.recv(), command_body("start"))
        thread.join(WAIT)
        assert isinstance(out["r"], CommandResult)
    finally:
        conn.close()
    assert orbit_threads() == []


def test_untrusted_certificate_is_refused(tls_server: ScriptedServer) -> None:
    """The default context (system CAs only) refuses the throwaway CA's certificate."""
    with pytest.raises(WorkerDisconnected) as caught:
        Client(tls_server.url, TOKEN).dial_worker(registration(), timeout=WAIT)
    assert "certificate" in str(caught.value)
    assert caught.value.dial_stage is None  # refused, not lost: the reconnects back off
    assert tls_server.requests == []


def test_reset_mid_handshake_is_a_lost_connection(trusting: ssl.SSLContext) -> None:
    """A peer that resets during the TLS handshake: a lost connection in stage "tls"."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def reset_one() -> None:
            conn, _ = listener.accept()
            conn.recv(4096)  # the ClientHello, never answered
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST

        thread = threading.Thread(target=reset_one, daemon=True)
        thread.start()
        with pytest.raises(WorkerDisconnected) as caught:
            Client(f"wss://localhost:{port}", TOKEN, ssl_context=trusting).dial_worker(
                registration(), timeout=WAIT
            )
        thread.join(WAIT)
    assert caught.value.dial_stage == "tls"


def test_host_name_mismatch_is_refused(ca: trustme.CA, trusting: ssl.SSLContext) -> None:
    """A trusted certificate for another host name is refused before the upgrade is sent."""
    with ScriptedServer(ssl_context=_server_context(ca, "orbit.example")) as server:
        with pytest.raises(WorkerDisconnected) as caught:
            Client(server.url, TOKEN, ssl_context=trusting).dial_worker(registration())
        assert "certificate" in str(caught.value)
        assert server.requests == []


def _common_name_only_context(ca: trustme.CA, folder: Path) -> ssl.SSLContext:
    # trustme always writes a subjectAltName (and cryptography refuses an empty one), so the
    # certificate without one is signed here with the CA's key.
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    chain = folder / "cn-only.pem"
    chain.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        + cert.public_bytes(serialization.Encoding.PEM)
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(chain)
    return context


def test_a_common_name_only_certificate_is_refused(
    ca: trustme.CA, trusting: ssl.SSLContext, tmp_path: Path
) -> None:
    """A trusted certificate naming localhost only in its common name (no subjectAltName entry)
    is refused, although the caller's context allows the common-name fallback."""
    server_context = _common_name_only_context(ca, tmp_path)
    assert trusting.hostname_checks_common_name  # the standard library's default: True
    with ScriptedServer(ssl_context=server_context) as server:
        with pytest.raises(WorkerDisconnected) as caught:
            Client(server.url, TOKEN, ssl_context=trusting).dial_worker(
                registration(), timeout=WAIT
            )
        assert "certificate" in str(caught.value)
        assert server.requests == []
    assert not trusting.hostname_checks_common_name


def test_a_subject_alt_name_certificate_is_accepted(
    ca: trustme.CA, trusting: ssl.SSLContext
) -> None:
    """The same host in the certificate's subjectAltName (with the same common name) is the
    supported case: the dial completes."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", common_name="localhost").configure_cert(server_context)
    with ScriptedServer(ssl_context=server_context) as server:
        conn, _peer = open_pair(server, ssl_context=trusting)
        try:
            assert conn.err is None
        finally:
            conn.close()


def test_concurrent_calls_and_pushes_over_tls(
    tls_server: ScriptedServer, trusting: ssl.SSLContext
) -> None:
    """Eight threads calling while the reader reads pushes: every answer arrives intact."""
    threads_n, calls_n = 8, 25
    conn, peer = open_pair(tls_server, ssl_context=trusting)

    def serve() -> None:
        for i in range(threads_n * calls_n):
            peer.ack(peer.recv(), command_body("renew"))
            if i % 40 == 0:
                peer.push("task.assign", assignment_body(attempt_id=f"{i + 1:032x}"))

    results: list[Any] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(calls_n):
            try:
                value: Any = conn.renew(REF, timeout=WAIT)
            except BaseException as exc:
                value = exc
            with lock:
                results.append(value)

    server_thread = threading.Thread(target=serve, daemon=True)
    server_thread.start()
    workers = [threading.Thread(target=work, daemon=True) for _ in range(threads_n)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        server_thread.join(WAIT)
        assert len(results) == threads_n * calls_n
        assert all(isinstance(r, CommandResult) for r in results), {type(r) for r in results}
        assert [conn.next_assignment(timeout=WAIT).attempt_id for _ in range(5)]
        assert conn.err is None
    finally:
        conn.close()


def test_no_second_thread_touches_the_tls_socket_before_the_welcome(
    tls_server: ScriptedServer, trusting: ssl.SSLContext
) -> None:
    """Until the welcome has been read, the dialing thread is the only one on the socket.
    OpenSSL forbids reading and writing one TLS connection from two threads at once; the
    dial's own reads take the server's post-handshake messages (TLS 1.3 session tickets), so
    none can arrive while a writer is mid-write once the reader thread runs."""
    seen: dict[str, Any] = {}

    def serve() -> None:
        peer = tls_server.accept()
        hello = peer.recv()
        seen["before"] = orbit_threads()  # the client waits for its welcome now
        peer.welcome(hello)
        seen["peer"] = peer

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conn = Client(tls_server.url, TOKEN, ssl_context=trusting).dial_worker(registration())
    try:
        thread.join(WAIT)
        assert not [name for name in seen["before"] if "reader" in name], seen["before"]
        assert [name for name in orbit_threads() if "reader" in name]
    finally:
        conn.close()
