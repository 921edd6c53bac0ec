"""TLS on keyguard's listener (listen_tls): redis-cli --tls and redis-py ssl=True through it, client
certificates required, tenants named by client certificates, and a rotated listener certificate."""
import os
import socket
import ssl
import subprocess

import pytest
import redis

from conftest import Keyguard, Redis, wait_until
from test_tls import make_ca, make_cert, rotated_files, run


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """keyguard's certificates (from a CA and from a second CA), and client certificates: one per
    tenant (by CN, by a DNS SAN), one no tenant lists, and one from the second CA."""
    d = str(tmp_path_factory.mktemp("listen-pki"))
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "server", "ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(d, "other-server", "other-ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(d, "app-a", "ca", "app-a.example")
    make_cert(d, "app-c", "ca", "some-pod", "DNS:app-c.internal")
    make_cert(d, "nobody", "ca", "nobody.example")
    make_cert(d, "stranger", "other-ca", "app-a.example")
    return lambda name: os.path.join(d, name)


def listen_yaml(pki, extra="", cert="server.crt", key="server.key"):
    return "listen_tls:\n  cert_file: %s\n  key_file: %s\n%s" % (pki(cert), pki(key), extra)


def tls_client(kg, pki, cert=None, ca="ca.crt", **kw):
    """A redis-py client of keyguard's TLS listener, trusting `ca`, with client certificate `cert`."""
    extra = {"ssl_certfile": pki(cert + ".crt"), "ssl_keyfile": pki(cert + ".key")} if cert else {}
    return redis.Redis(host="127.0.0.1", port=kg.port, ssl=True, ssl_ca_certs=pki(ca), socket_timeout=10,
                       **extra, **kw)


def raw_ping(kg, pki, cert=None):
    """PING over one TLS connection to keyguard: the reply, or the reason of the TLS alert that
    refused the connection (TLS 1.3 refuses a client certificate after the client's handshake)."""
    ctx = ssl.create_default_context(cafile=pki("ca.crt"))
    if cert:
        ctx.load_cert_chain(pki(cert + ".crt"), pki(cert + ".key"))
    with socket.create_connection(("127.0.0.1", kg.port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            try:
                s.sendall(b"PING\r\n")
                return s.recv(100)
            except ssl.SSLError as e:
                return e.reason


def cli(kg, pki, *args, cert=None):
    tls = ["--tls", "--cacert", pki("ca.crt")]
    if cert:
        tls += ["--cert", pki(cert + ".crt"), "--key", pki(cert + ".key")]
    return subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(kg.port), *tls, *args], capture_output=True,
                          text=True, timeout=30)


def test_redis_cli_and_redis_py_over_the_tls_listener(pki):
    r = Redis()
    kg = Keyguard(r.port, config=listen_yaml(pki))
    try:
        out = cli(kg, pki, "SET", "ltls:k", "v")
        assert (out.returncode, out.stdout) == (0, "OK\n"), out.stderr
        out = cli(kg, pki, "GET", "ltls:k")
        assert (out.returncode, out.stdout) == (0, "v\n"), out.stderr
        c = tls_client(kg, pki)
        assert c.get("ltls:k") == b"v"
        big = os.urandom(3 << 20)  # many TLS records each way
        assert c.set("ltls:big", big) is True
        assert c.get("ltls:big") == big
        p = c.pipeline(transaction=False)
        for _ in range(2000):
            p.incr("ltls:n")
        assert p.execute() == list(range(1, 2001))
        direct = redis.Redis(port=r.port)
        assert direct.get("ltls:n") == b"2000"
        assert direct.strlen("ltls:big") == 3 << 20
        # Three TLS clients so far; the fixture's plain TCP probe of the port failed its handshake.
        assert kg.metric('keyguard_client_tls_handshakes_total{resumed="false"}') + kg.metric(
            'keyguard_client_tls_handshakes_total{resumed="true"}') == 3
        wait_until(lambda: kg.metric("keyguard_client_tls_handshake_failures_total") == 1,
                   "the port probe's failed handshake")
        # A plaintext client gets nothing and is closed.
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=kg.port, socket_timeout=10).ping()
        wait_until(lambda: kg.metric("keyguard_client_tls_handshake_failures_total") == 2, "the plaintext client")
        assert c.ping() is True
    finally:
        kg.stop()
        r.stop()


def test_a_client_without_a_trusted_certificate_is_refused_when_one_is_required(pki):
    r = Redis()
    kg = Keyguard(r.port, config=listen_yaml(pki, "  ca_file: %s\n  require_client_cert: true\n" % pki("ca.crt")))
    try:
        wait_until(lambda: kg.metric("keyguard_client_tls_handshake_failures_total") == 1, "the port probe")
        assert tls_client(kg, pki, cert="app-a").set("req:k", "1") is True
        assert raw_ping(kg, pki) == "TLSV13_ALERT_CERTIFICATE_REQUIRED"
        assert raw_ping(kg, pki, cert="stranger") == "TLSV1_ALERT_UNKNOWN_CA"
        assert raw_ping(kg, pki, cert="app-a") == b"+PONG\r\n"
        wait_until(lambda: kg.metric("keyguard_client_tls_handshake_failures_total") == 3, "two refused clients")
        out = cli(kg, pki, "SET", "req:k", "3")
        assert out.stdout != "OK\n"
        wait_until(lambda: kg.metric("keyguard_client_tls_handshake_failures_total") == 4, "redis-cli refused")
        out = cli(kg, pki, "INCR", "req:k", cert="app-a")
        assert (out.returncode, out.stdout) == (0, "2\n"), out.stderr
        assert redis.Redis(port=r.port).get("req:k") == b"2"
    finally:
        kg.stop()
        r.stop()


TENANTS = """tenancy:
  users:
    - {name: app-a, cert_names: [app-a.example], prefix: "tenant:a:"}
    - {name: app-b, password: secret-b, prefix: "tenant:b:"}
    - {name: app-c, cert_names: [app-c.internal], password: secret-c, prefix: "tenant:c:"}
"""


def test_a_verified_client_certificate_names_the_tenant(pki):
    r = Redis()
    kg = Keyguard(r.port, config=listen_yaml(pki, "  ca_file: %s\n" % pki("ca.crt")) + TENANTS)
    try:
        a = tls_client(kg, pki, cert="app-a")  # by the subject CN
        assert a.set("k", "from-a") is True
        assert a.keys("*") == [b"k"]
        c = tls_client(kg, pki, cert="app-c")  # by a DNS subjectAltName
        assert c.set("k", "from-c") is True
        assert c.get("k") == b"from-c"
        assert a.get("k") == b"from-a"
        # A certificate no user lists, or none at all: AUTH as before.
        for cert in ("nobody", None):
            other = tls_client(kg, pki, cert=cert)
            with pytest.raises(redis.AuthenticationError):
                other.set("k", "x")
        b = tls_client(kg, pki, username="app-b", password="secret-b")
        assert b.set("k", "from-b") is True
        # A certificate-only user cannot AUTH with a password.
        with pytest.raises(redis.ResponseError, match="^WRONGPASS invalid username-password pair"):
            tls_client(kg, pki).execute_command("AUTH", "app-a", "")
        # RESET comes back to the certificate's tenant.
        assert a.execute_command("RESET") == "RESET"
        assert a.get("k") == b"from-a"
        direct = redis.Redis(port=r.port)
        assert sorted(direct.keys("*")) == [b"tenant:a:k", b"tenant:b:k", b"tenant:c:k"]
        assert direct.get("tenant:a:k") == b"from-a"
        assert direct.get("tenant:c:k") == b"from-c"
    finally:
        kg.stop()
        r.stop()


def test_a_rotated_listener_certificate_is_used_by_new_connections(pki, tmp_path):
    r = Redis()
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    install = rotated_files(pki, cert, key)
    install("server")
    kg = Keyguard(r.port, config="listen_tls:\n  cert_file: %s\n  key_file: %s\n" % (cert, key))
    try:
        old = tls_client(kg, pki)
        assert old.set("rot:k", "1") is True
        install("other-server")

        def served_by_other_ca():
            try:
                return tls_client(kg, pki, ca="other-ca.crt").incr("rot:n") > 0
            except (redis.ConnectionError, ssl.SSLError):
                return False

        wait_until(served_by_other_ca, "a new connection with the new certificate")
        assert kg.metric("keyguard_client_tls_reloads_total") == 1
        # The old CA no longer verifies new connections; the open one keeps going.
        with pytest.raises((redis.ConnectionError, ssl.SSLError)):
            tls_client(kg, pki).ping()
        assert old.incr("rot:k") == 2
        assert redis.Redis(port=r.port).get("rot:k") == b"2"
    finally:
        kg.stop()
        r.stop()


def test_check_config_shows_the_listener_tls_and_refuses_what_cannot_work(pki, tmp_path):
    config = tmp_path / "kg.yaml"
    config.write_text(listen_yaml(pki, "  ca_file: %s\n  require_client_cert: true\n  min_version: \"1.3\"\n" %
                                  pki("ca.crt")))
    out = run("check-config", str(config))
    assert out.returncode == 0, out.stderr
    assert ("listen_tls:\n  certificate: %s (key %s)\n  client_ca: %s\n  client_certificate: required\n"
            "  min_version: 1.3\n  ciphers: default\n  ciphersuites: default\n" %
            (pki("server.crt"), pki("server.key"), pki("ca.crt"))) in out.stdout
    for yaml, error in [
        ("listen_tls:\n  require_client_cert: true\n  cert_file: %s\n  key_file: %s\n" % (pki("server.crt"),
                                                                                      pki("server.key")),
         "listen_tls.require_client_cert: needs ca_file or ca_dir (the CAs of client certificates)"),
        ("listen_tls:\n  ca_file: %s\n" % pki("ca.crt"), "listen_tls.cert_file: required (keyguard's certificate)"),
        (listen_yaml(pki) + TENANTS,
         "tenancy.users: cert_names need listen_tls with ca_file or ca_dir (to verify the certificates)"),
    ]:
        config.write_text(yaml)
        out = run("check-config", str(config))
        assert (out.returncode, out.stderr) == (2, "keyguard: %s: %s\n" % (config, error))
