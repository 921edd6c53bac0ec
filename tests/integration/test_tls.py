"""Upstream URLs, TLS to a real redis-server started with --tls-port, and its failures."""
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest
import redis

from conftest import KEYGUARD, Keyguard, Redis, wait_until
from resp import RespConn, encode


def run(*args, timeout=60):
    return subprocess.run([KEYGUARD, *args], capture_output=True, text=True, timeout=timeout)


def test_a_password_in_the_upstream_url_is_refused_and_never_echoed():
    out = run("--upstream", "redis://app:hunter2@127.0.0.1:6379")
    assert out.returncode == 2
    line = json.loads(out.stderr)
    assert line["event"] == "startup_failed"
    assert line["error"] == ("--upstream: a password in the URL is refused: put it in the file named by "
                             "upstream_auth.password_file (or sentinel.password_file for the Sentinels)")
    assert "hunter2" not in out.stdout + out.stderr


def test_check_config_shows_the_upstream_tls_and_sentinel_settings_without_secrets(tmp_path):
    password = tmp_path / "sentinel-password"
    password.write_text("hunter2\n")
    config = tmp_path / "kg.yaml"
    config.write_text("upstream: rediss-sentinel://mymaster@10.0.0.1:26379,10.0.0.2:26379\n"
                      "upstream_tls:\n  ca_file: /etc/kg/ca.pem\n  server_name: redis.internal\n"
                      "sentinel:\n  password_file: %s\n" % password)
    out = run("check-config", str(config))
    assert out.returncode == 0, out.stderr
    assert "upstream: rediss-sentinel://mymaster@10.0.0.1:26379,10.0.0.2:26379\n" in out.stdout
    assert ("upstream_tls:\n  ca: /etc/kg/ca.pem\n  client_certificate: none\n  server_name: redis.internal\n"
            "  verify: on\n  min_version: 1.2\n  ciphers: default\n  ciphersuites: default\n") in out.stdout
    assert "sentinel:\n  master: mymaster\n  sentinels: 2\n  auth: password (%s)\n" % password in out.stdout
    assert "hunter2" not in out.stdout

    config.write_text("upstream: 127.0.0.1:6379\nupstream_tls:\n  ca_file: /etc/kg/ca.pem\n")
    out = run("check-config", str(config))
    assert out.returncode == 2
    assert out.stderr == ("keyguard: %s: upstream_tls: set, but upstream '127.0.0.1:6379' is not TLS (rediss:// or "
                          "rediss-sentinel://)\n" % config)


# --- TLS to a real redis-server --------------------------------------------------------------

def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "30",
            "-keyout", "%s.key" % name, "-out", "%s.crt" % name, "-subj", "/CN=%s" % name, cwd=d)


def make_cert(d, name, ca, cn, san=None):
    """A key and a certificate for `cn` (with subjectAltName `san`) signed by CA `ca`."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "%s.key" % name,
            "-out", "%s.csr" % name, "-subj", "/CN=%s" % cn, cwd=d)
    ext = os.path.join(d, "%s.ext" % name)
    with open(ext, "w") as f:
        f.write("basicConstraints=CA:FALSE\n" + ("subjectAltName=%s\n" % san if san else ""))
    openssl("x509", "-req", "-in", "%s.csr" % name, "-CA", "%s.crt" % ca, "-CAkey", "%s.key" % ca, "-CAcreateserial",
            "-days", "30", "-out", "%s.crt" % name, "-extfile", ext, cwd=d)


def make_expired_cert(d, name, ca, cn, san):
    """As make_cert, valid only in January 2020 (`openssl ca` sets past dates; OpenSSL 3.0's x509
    cannot)."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "%s.key" % name,
            "-out", "%s.csr" % name, "-subj", "/CN=%s" % cn, cwd=d)
    with open(os.path.join(d, "%s.ext" % name), "w") as f:
        f.write("basicConstraints=CA:FALSE\nsubjectAltName=%s\n" % san)
    with open(os.path.join(d, "%s.cnf" % name), "w") as f:
        f.write("[ca]\ndefault_ca=d\n[d]\ndatabase=%s.index\nnew_certs_dir=.\nserial=%s.serial\ndefault_md=sha256\n"
                "policy=p\n[p]\ncommonName=supplied\n" % (name, name))
    open(os.path.join(d, "%s.index" % name), "w").close()
    with open(os.path.join(d, "%s.serial" % name), "w") as f:
        f.write("01\n")
    openssl("ca", "-batch", "-notext", "-config", "%s.cnf" % name, "-cert", "%s.crt" % ca, "-keyfile", "%s.key" % ca,
            "-in", "%s.csr" % name, "-out", "%s.crt" % name, "-startdate", "20200101000000Z", "-enddate",
            "20200201000000Z", "-extfile", "%s.ext" % name, cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and the server and client certificates it signed (and a server certificate that has
    expired), and a second CA nobody trusts."""
    d = str(tmp_path_factory.mktemp("pki"))
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "server", "ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_expired_cert(d, "expired", "ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(d, "client", "ca", "keyguard")
    make_cert(d, "client2", "ca", "keyguard")  # the next certificate of a rotation
    make_cert(d, "stranger", "other-ca", "keyguard")
    return lambda name: os.path.join(d, name)


def tls_redis(pki, *extra, server="server"):
    return Redis(*extra, tls={"cert": pki(server + ".crt"), "key": pki(server + ".key"), "ca": pki("ca.crt")})


def direct(r, pki):
    """A redis-py client of the TLS redis-server itself, as a client with the CA's certificate."""
    return redis.Redis(host="localhost", port=r.port, ssl=True, ssl_ca_certs=pki("ca.crt"),
                       ssl_certfile=pki("client.crt"), ssl_keyfile=pki("client.key"))


def tls_keyguard(r, pki, tls_yaml, host="localhost"):
    return Keyguard(r.port, config="upstream_tls:\n" + tls_yaml, upstream="rediss://%s:%d" % (host, r.port))


def exercise(c, r, pki):
    """Commands through keyguard `c` to TLS server `r`: a big value, a pipeline, all stored."""
    assert c.set("tls:k", "v") is True
    assert c.get("tls:k") == b"v"
    big = os.urandom(3 << 20)  # many TLS records each way, and writes the socket does not take at once
    assert c.set("tls:big", big) is True
    assert c.get("tls:big") == big
    p = c.pipeline(transaction=False)
    for i in range(2000):
        p.incr("tls:n")
    assert p.execute() == list(range(1, 2001))
    assert direct(r, pki).get("tls:n") == b"2000"
    assert direct(r, pki).strlen("tls:big") == 3 << 20


@pytest.mark.dedicated_only(reason="the shared connections stay open; test_tls_over_shared_connections covers TLS there")
def test_commands_go_over_tls_and_sessions_resume(pki):
    r = tls_redis(pki, "--tls-auth-clients", "no")
    kg = tls_keyguard(r, pki, "  ca_file: %s\n" % pki("ca.crt"))
    try:
        # The command table was asked of the server over TLS too (module commands are learnt).
        assert kg.events("command_table") == [
            {"level": "info", "event": "command_table", "builtin": 240, "added_from_upstream": 0}]
        c = redis.Redis(port=kg.port)
        exercise(c, r, pki)
        # Once every connection so far has closed, a new one resumes the session the server gave.
        c.connection_pool.disconnect()
        settle(kg, 2)
        resumed = kg.metric('keyguard_upstream_tls_handshakes_total{resumed="true"}')
        c2 = redis.Redis(port=kg.port)
        assert c2.ping() is True
        assert kg.metric('keyguard_upstream_tls_handshakes_total{resumed="true"}') == resumed + 1
        assert kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 0
        assert kg.http("/readyz") == (200, "ready\n")
        # The IP address is verified against the certificate's IP SAN.
        kg_ip = tls_keyguard(r, pki, "  ca_file: %s\n" % pki("ca.crt"), host="127.0.0.1")
        assert redis.Redis(port=kg_ip.port).echo("by address") == b"by address"
        kg_ip.stop()
    finally:
        kg.stop()
        r.stop()



def settle(kg, accepted):
    """Waits until keyguard has accepted `accepted` client connections in all (wait_port()'s, which
    only looked for keyguard listening, is the first) and every one of them has ended, and with
    it its upstream connection. In CI the worker that took wait_port()'s connection reached it
    only during the test's next PING, whose TLS resumption counted twice."""
    wait_until(lambda: kg.metric("keyguard_client_connections_total") >= accepted, "the connections accepted")
    wait_until(lambda: kg.metric("keyguard_client_connections") == 0, "the client connections ended")
    wait_until(lambda: kg.metric("keyguard_upstream_connections") == 0, "the upstream connections closed")


class ClosingTlsServer:
    """A TLS server on a free port that answers each connection's first command with +PONG, then
    closes it without close_notify (as a server that is killed, or a proxy in front of Redis,
    may): the client sees the TCP close alone."""

    def __init__(self, pki):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(pki("server.crt"), pki("server.key"))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.one, args=(raw,), daemon=True).start()

    def one(self, raw):
        try:
            conn = self.context.wrap_socket(raw, server_side=True)
            if conn.recv(1024):
                conn.sendall(b"+PONG\r\n")
        except (OSError, ssl.SSLError):
            pass
        raw.close()  # the TCP close alone: no unwrap(), so no close_notify

    def stop(self):
        self.listener.close()


@pytest.mark.dedicated_only(reason="counts one upstream TLS connection per client connection")
def test_a_session_resumes_after_a_server_closed_without_close_notify(pki):
    """OpenSSL 3 calls a close without close_notify an unexpected end, a fatal error that marks
    the connection's session not resumable; that session is also the one kept to offer next."""
    server = ClosingTlsServer(pki)
    kg = tls_keyguard(server, pki, "  ca_file: %s\n" % pki("ca.crt"))
    full = 'keyguard_upstream_tls_handshakes_total{resumed="false"}'
    resumed = 'keyguard_upstream_tls_handshakes_total{resumed="true"}'
    try:
        # The command table's connection at start-up gets sessions; each one after resumes (all
        # of them did full handshakes: the session kept to offer was marked when the server closed).
        settle(kg, 1)
        assert kg.metric(full) == 1
        assert ping_reply(kg).startswith(b"+PONG\r\n")
        for i in range(3):
            settle(kg, 2 + i)
            before = kg.metric(resumed)
            assert ping_reply(kg).startswith(b"+PONG\r\n")
            settle(kg, 3 + i)
            assert (kg.metric(full), kg.metric(resumed)) == (1, before + 1)
        assert kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 0
    finally:
        kg.stop()
        server.stop()

def open_at_once(port, n):
    """`n` connections opened by `n` threads at once, each answering PING, then all closed."""
    socks = []

    def one():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"PING\r\n")
        assert s.recv(64) == b"+PONG\r\n"
        socks.append(s)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(socks) == n
    for s in socks:
        s.close()


@pytest.mark.dedicated_only(reason="counts one upstream TLS connection per client connection")
def test_connections_that_start_together_each_resume_a_session(pki):
    """Each server's sessions are kept apart and an unused one is offered first, so a burst of new
    connections resumes rather than all offering the one session the server issued last (which
    made 10 to 46 of these 150 connections do a full handshake). Connections get copies, never an
    object the pool holds: OpenSSL marks a connection's session not resumable when it ends without
    close_notify, and when that was the pool's newest, every later offer of it failed (0 to 16 of
    150 did a full handshake, more with the cores loaded; now none, loaded or not)."""
    r = tls_redis(pki, "--tls-auth-clients", "no")
    kg = tls_keyguard(r, pki, "  ca_file: %s\n" % pki("ca.crt"))
    full = 'keyguard_upstream_tls_handshakes_total{resumed="false"}'
    resumed = 'keyguard_upstream_tls_handshakes_total{resumed="true"}'
    try:
        for _ in range(2):  # the first bursts make the full handshakes whose sessions the next ones take
            open_at_once(kg.port, 50)
            wait_until(lambda: kg.metric("keyguard_upstream_connections") == 0, "the upstream connections closed")
        before, resumed_before = kg.metric(full), kg.metric(resumed)
        for _ in range(3):
            open_at_once(kg.port, 50)
            wait_until(lambda: kg.metric("keyguard_upstream_connections") == 0, "the upstream connections closed")
        assert (kg.metric(full) - before, kg.metric(resumed) - resumed_before) == (0, 150)
    finally:
        kg.stop()
        r.stop()


def ping_reply(kg):
    """What a new connection through `kg` gets for PING: the reply, and b"<closed>" after an error."""
    c = RespConn(kg.port)
    try:
        reply = c.exchange(encode("PING"), replies=1)
        if reply.startswith(b"+"):
            return reply
        # After an error keyguard closes: read to the close (the first read may have seen it, and
        # the close may already have reset the connection).
        try:
            rest = c.exchange(b"", closed=True)
        except (BrokenPipeError, ConnectionResetError):
            rest = b"<closed>"
        return reply.replace(b"<closed>", b"") + rest
    finally:
        c.close()


def tls_refusal(kg, reason):
    """Asserts a client through `kg` gets the TLS error with `reason`, and the counter says tls."""
    assert ping_reply(kg) == b"-ERR keyguard: upstream TLS: %s\r\n<closed>" % reason.encode()


@pytest.mark.dedicated_only(reason="the client stays connected, and the shared connections count a TLS error at each retry")
@pytest.mark.parametrize("server,tls_yaml,reason", [
    ("server", "  ca_file: {other_ca}\n", "certificate verify failed: self-signed certificate in certificate chain"),
    ("server", "  ca_file: {ca}\n  server_name: redis.example.com\n", "certificate verify failed: hostname mismatch"),
    ("expired", "  ca_file: {ca}\n", "certificate verify failed: certificate has expired"),
])
def test_an_untrusted_misnamed_or_expired_server_is_refused_with_the_reason(pki, server, tls_yaml, reason):
    r = tls_redis(pki, "--tls-auth-clients", "no", server=server)
    kg = tls_keyguard(r, pki, tls_yaml.format(other_ca=pki("other-ca.crt"), ca=pki("ca.crt")))
    try:
        tls_refusal(kg, reason)
        # The fixture's wait for the port made a connection too: two handshakes failed, no more.
        wait_until(lambda: kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 2, "two TLS errors")
        assert kg.metric('keyguard_upstream_errors_total{reason="connect"}') == 0
        status, body = kg.http("/readyz")
        assert (status, body) == (503, "upstream rediss://localhost:%d: TLS: %s\n" % (r.port, reason))
        assert kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 2
    finally:
        kg.stop()
        r.stop()


def rotated_files(pki, cert, key):
    """A function that installs certificate NAME (NAME.crt, NAME.key from `pki`) as the files `cert`
    and `key`, as a Secret update does: new files renamed into place, the old ones still open
    elsewhere."""
    def install(name):
        for src, dst in ((pki(name + ".crt"), cert), (pki(name + ".key"), key)):
            shutil.copy(src, dst + ".new")
            os.rename(dst + ".new", dst)
    return install


@pytest.mark.dedicated_only(reason="each client connection makes its own upstream connection, so each takes the files of its time")
def test_a_client_certificate_rotated_under_load_loses_no_command(pki, tmp_path):
    """Four clients connect, INCR ten times and reconnect, without a pause, while the client
    certificate and key a server requiring them is given are rotated four times (each file renamed
    into place in turn, so a connection may see a new certificate with the old key): every INCR is
    acknowledged and stored, no connection fails, and each rotation is one reload."""
    r = tls_redis(pki, "--tls-auth-clients", "yes")
    cert, key = str(tmp_path / "client.crt"), str(tmp_path / "client.key")
    install = rotated_files(pki, cert, key)
    install("client")
    kg = tls_keyguard(r, pki, "  ca_file: %s\n  cert_file: %s\n  key_file: %s\n" % (pki("ca.crt"), cert, key))
    stop = threading.Event()
    acked = [0] * 4
    errors = []

    def load(i):
        while not stop.is_set():
            try:
                c = redis.Redis(port=kg.port, socket_timeout=10)
                for _ in range(10):
                    assert c.incr("rotation:n") > 0
                    acked[i] += 1
                c.close()
            except Exception as e:  # noqa: BLE001 (any failure is the finding)
                errors.append(repr(e))
                return

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for n, name in enumerate(["client2", "client", "client2", "client"], start=1):
            time.sleep(0.3)
            install(name)
            wait_until(lambda: kg.metric("keyguard_upstream_tls_reloads_total") == n, "rotation %d read" % n)
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    try:
        assert errors == []
        assert sum(acked) >= 100
        assert direct(r, pki).get("rotation:n") == str(sum(acked)).encode()
        assert kg.metric("keyguard_upstream_tls_reloads_total") == 4
        assert kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 0
        assert kg.metric('keyguard_upstream_tls_handshakes_total{resumed="false"}') + \
            kg.metric('keyguard_upstream_tls_handshakes_total{resumed="true"}') >= sum(acked) // 10
    finally:
        kg.stop()
        r.stop()


@pytest.mark.dedicated_only(reason="a shared connection keeps its certificate while it lives; new ones (reconnects, pins) take the new files")
def test_client_certificates_for_a_server_that_requires_them_and_their_rotation(pki, tmp_path):
    r = tls_redis(pki, "--tls-auth-clients", "yes")
    cert, key = str(tmp_path / "client.crt"), str(tmp_path / "client.key")
    install = rotated_files(pki, cert, key)
    install("client")
    kg = tls_keyguard(r, pki, "  ca_file: %s\n  cert_file: %s\n  key_file: %s\n" % (pki("ca.crt"), cert, key))
    try:
        old = redis.Redis(port=kg.port)
        assert old.set("mtls:k", "1") is True
        # A certificate the server does not trust: new connections fail, the open one keeps going.
        install("stranger")
        # The files are looked at (at most once a second) when a connection is made.
        refused = b"-ERR keyguard: upstream TLS: tlsv1 alert unknown ca\r\n<closed>"
        wait_until(lambda: ping_reply(kg) == refused, "a new connection with the new certificate")
        assert kg.metric("keyguard_upstream_tls_reloads_total") == 1
        assert old.incr("mtls:k") == 2
        # The trusted one again: new connections work.
        install("client")
        wait_until(lambda: ping_reply(kg) == b"+PONG\r\n", "a new connection with the trusted certificate")
        assert kg.metric("keyguard_upstream_tls_reloads_total") == 2
        assert redis.Redis(port=kg.port).incr("mtls:k") == 3
        assert old.incr("mtls:k") == 4
        assert direct(r, pki).get("mtls:k") == b"4"
        # Without a client certificate at all the server refuses (TLS 1.3 says so after the handshake).
        kg_bare = tls_keyguard(r, pki, "  ca_file: %s\n" % pki("ca.crt"))
        assert ping_reply(kg_bare) == b"-ERR keyguard: upstream TLS: tlsv13 alert certificate required\r\n<closed>"
        kg_bare.stop()
    finally:
        kg.stop()
        r.stop()


def test_tls_over_shared_connections(pki):
    """Shared upstream connections over TLS: commands (a big value, a pipeline) and a pinned
    transaction; a server with the wrong name gets each command the TLS reason, the client stays."""
    r = tls_redis(pki, "--tls-auth-clients", "no")
    kg = Keyguard(r.port, config="upstream_connections: shared\nupstream_tls:\n  ca_file: %s\n" % pki("ca.crt"),
                  upstream="rediss://localhost:%d" % r.port, extra=("--upstream-connections", "shared"))
    try:
        # Each worker's shared connection does its first TLS handshake as keyguard starts; a command
        # before it is up gets "upstream unavailable" (one CI run under load saw it).
        wait_until(lambda: kg.metric('keyguard_upstream_connections_by_kind{kind="shared"}') == 4,
                   "both workers' shared connections (read and write lanes) up")
        c = redis.Redis(port=kg.port)
        exercise(c, r, pki)
        t = c.pipeline(transaction=True)
        t.incr("tls:n").get("tls:n")
        assert t.execute() == [2001, b"2001"]
        assert direct(r, pki).get("tls:n") == b"2001"
        wait_until(lambda: kg.metric('keyguard_upstream_connections_by_kind{kind="pinned"}') == 0, "the pin ended")
        assert kg.metric('keyguard_upstream_connections_by_kind{kind="shared"}') == 4
    finally:
        kg.stop()
    bad = Keyguard(r.port, config="upstream_tls:\n  ca_file: %s\n  server_name: redis.example.com\n" % pki("ca.crt"),
                   upstream="rediss://localhost:%d" % r.port, extra=("--upstream-connections", "shared"))
    try:
        conn = RespConn(bad.port)
        reason = "ERR keyguard: upstream TLS: certificate verify failed: hostname mismatch"
        # Until the first handshake has failed, the error cannot say why yet.
        wait_until(lambda: str(conn.call("PING")) == reason, "the TLS reason")
        for _ in range(3):
            assert str(conn.call("PING")) == reason  # the client stays connected
        assert bad.metric('keyguard_upstream_errors_total{reason="tls"}') >= 1
    finally:
        bad.stop()
        r.stop()


def test_the_size_probe_asks_over_tls(pki):
    """The sizing probe had a plain TCP connection of its own: in front of a TLS server it never
    learned a size. Its connections are made as the clients' are: a big hash read with HGET is a
    big_key_access finding with its exact size."""
    r = tls_redis(pki, "--tls-auth-clients", "no")
    kg = tls_keyguard(r, pki, "  ca_file: %s\n" % pki("ca.crt"))
    try:
        direct(r, pki).hset("feed:1", mapping={"f%d" % i: i for i in range(6000)})
        assert redis.Redis(port=kg.port).hget("feed:1", "f7") == b"7"

        def found():
            status, body = kg.http("/debug/findings")
            return [(f["key"], f["elements"]) for f in json.loads(body)["findings"] if f["kind"] == "big_key_access"]

        assert wait_until(found, "the probe's finding") == [("feed:1", 6000)]
        assert kg.metric("keyguard_probed_keys_total") == 1
        assert kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 0
    finally:
        kg.stop()
        r.stop()


def test_pooled_connections_the_server_closed_are_not_pinned(pki):
    """An idle connection of the pool has unread TLS records (the session tickets, then the
    server's close_notify when it closes it: a timeout, CLIENT KILL, a restart): a closed one must
    not be taken for a pin (each transaction failed, "upstream unavailable", once per pooled
    connection, and again each time the pool's new ones timed out)."""
    r = tls_redis(pki, "--tls-auth-clients", "no")
    kg = Keyguard(r.port, config="upstream_connections: shared\nupstream_tls:\n  ca_file: %s\n" % pki("ca.crt"),
                  upstream="rediss://localhost:%d" % r.port, extra=("--upstream-connections", "shared"))
    idle = 'keyguard_upstream_connections_by_kind{kind="idle"}'
    try:
        c = redis.Redis(port=kg.port)
        t = c.pipeline(transaction=True)
        t.incr("tls:pinned")
        assert t.execute() == [1]  # the first pin fills the pool
        for i in range(2, 5):
            wait_until(lambda: kg.metric(idle) >= 2, "the pool filled")
            assert direct(r, pki).client_kill_filter(_type="normal", skipme=True) >= 2
            wait_until(lambda: kg.metric('keyguard_upstream_connections_by_kind{kind="shared"}') == 4,
                       "the shared connections back")
            t = c.pipeline(transaction=True)
            t.incr("tls:pinned")
            assert t.execute() == [i]
    finally:
        kg.stop()
        r.stop()
