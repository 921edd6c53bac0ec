"""keyguard audit and migrate reach the upstream as the proxy does: over TLS (rediss://, with the
config's upstream_tls: CA, client certificate, server name), through a Sentinel group
(redis-sentinel:// and rediss-sentinel://, with the sentinel: and upstream_auth: credentials), and
say clearly why when they cannot. Real redis-server and Sentinel processes, openssl-made
certificates; the audit of a rediss-cluster:// upstream is in test_cluster.py."""
import itertools
import json
import os
import shutil
import subprocess
import tempfile

import pytest
import redis

from conftest import KEYGUARD, Redis, file_output, free_port, output_file, start_listening
from test_audit import CONFIG as AUDIT_CONFIG
from test_tls import make_ca, make_cert

MASTER = "mymaster"
# test_audit's key policy (the legacy-profile rule) and audit settings, and a plain rename.
RULES = AUDIT_CONFIG + r"""migrations:
  - {name: carts, match: 'Cart-*', pattern: '^Cart-(\w+)$', rewrite: 'cart:$1', max_ops_per_second: 0}
"""
# Two names the legacy rule catches, one the built-in lowercase rule catches, two good ones.
KEYS = ["user:1:profile", "session:abc", "User_1001_Profile", "User_1002_Profile", "Cart Items"]


def fill(r):
    r.hset("user:1:profile", mapping={"name": "ada"})
    r.set("session:abc", "token", ex=600)
    r.set("User_1001_Profile", json.dumps({"name": "cy"}))
    r.set("User_1002_Profile", json.dumps({"name": "di"}))
    r.set("Cart Items", "three")


def check_audit(p, upstream):
    """The audit's JSON report finds exactly the keys fill() wrote, and the names they break."""
    assert p.returncode == 0, p.stderr
    j = json.loads(p.stdout)
    assert (j["upstream"], j["scanned"], j["dbsize"], j["complete"]) == (upstream, len(KEYS), len(KEYS), True)
    naming = {n["rule"]: n for n in j["naming"]}
    assert sorted(naming) == ["legacy-profile", "lowercase"]
    assert sorted(e["key"] for e in naming["legacy-profile"]["examples"]) == ["User_1001_Profile", "User_1002_Profile"]
    assert [e["key"] for e in naming["lowercase"]["examples"]] == ["Cart Items"]


def run(tool, config, *args):
    return subprocess.run([KEYGUARD, tool, "--config", config, *args], capture_output=True, text=True, timeout=120)


def write(d, name, text):
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(text)
    return path


# --- TLS ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls():
    """A CA, the server and client certificates it signed, a CA nobody trusts, and a redis-server
    serving TLS only that wants a client certificate (--tls-auth-clients yes, Redis's default),
    filled: yields (server, path of a file in the certificate directory, direct client)."""
    d = tempfile.mkdtemp(prefix="kg-maint-pki-")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "server", "ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(d, "client", "ca", "keyguard")
    pki = lambda name: os.path.join(d, name)
    server = Redis(tls={"cert": pki("server.crt"), "key": pki("server.key"), "ca": pki("ca.crt")})
    direct = redis.Redis(host="localhost", port=server.port, ssl=True, ssl_ca_certs=pki("ca.crt"),
                         ssl_certfile=pki("client.crt"), ssl_keyfile=pki("client.key"), decode_responses=True)
    fill(direct)
    yield server, pki, direct
    server.stop()
    shutil.rmtree(d, ignore_errors=True)


CONFIGS = itertools.count()


def tls_config(pki, upstream, tls_yaml):
    return write(os.path.dirname(pki("ca.crt")), "kg-%d.yaml" % next(CONFIGS),
                 "upstream: %s\nupstream_tls:\n%s%s" % (upstream, tls_yaml, RULES))


def client_tls(pki):
    return "  ca_file: %s\n  cert_file: %s\n  key_file: %s\n" % (pki("ca.crt"), pki("client.crt"), pki("client.key"))


def test_audit_over_rediss_with_the_configured_ca_and_client_certificate(tls):
    server, pki, _ = tls
    url = "rediss://localhost:%d" % server.port
    config = tls_config(pki, url, client_tls(pki))
    check_audit(run("audit", config, "--format", "json", "--no-progress"), url)
    # By address: the certificate's IP SAN is what is verified.
    ip = "rediss://127.0.0.1:%d" % server.port
    check_audit(run("audit", config, "--upstream", ip, "--format", "json", "--no-progress"), ip)


@pytest.mark.parametrize("tls_yaml,reason", [
    ("  ca_file: {other_ca}\n  cert_file: {cert}\n  key_file: {key}\n",
     "TLS: certificate verify failed: self-signed certificate in certificate chain"),
    ("  ca_file: {ca}\n  cert_file: {cert}\n  key_file: {key}\n  server_name: redis.example.com\n",
     "TLS: certificate verify failed: hostname mismatch"),
    # Redis refuses a client without a certificate after the TLS 1.3 handshake.
    ("  ca_file: {ca}\n", "TLS: tlsv13 alert certificate required"),
])
def test_audit_says_why_tls_failed_and_exits_2(tls, tls_yaml, reason):
    server, pki, _ = tls
    url = "rediss://localhost:%d" % server.port
    config = tls_config(pki, url, tls_yaml.format(other_ca=pki("other-ca.crt"), ca=pki("ca.crt"),
                                                  cert=pki("client.crt"), key=pki("client.key")))
    p = run("audit", config, "--format", "json", "--no-progress")
    assert (p.returncode, p.stdout, p.stderr) == (2, "", "keyguard audit: upstream %s: %s\n" % (url, reason))


def test_migrate_copies_exactly_over_rediss(tls):
    server, pki, direct = tls
    direct.hset("Cart-a", mapping={"apple": "2", "pear": "1"})
    direct.set("Cart-b", "one melon", px=500000)
    expiry = direct.execute_command("PEXPIRETIME", "Cart-b")
    try:
        config = tls_config(pki, "rediss://localhost:%d" % server.port, client_tls(pki))
        p = run("migrate", config, "--migration", "carts", "copy", "--no-progress")
        assert p.returncode == 0, p.stdout + p.stderr
        line = [l for l in p.stdout.splitlines() if " scanned=" in l][-1]
        assert dict(kv.split("=", 1) for kv in line.split() if "=" in kv) == {
            "scanned": "2", "matched": "2", "copied": "2", "complete": "true", "cursor": "0"}
        assert direct.hgetall("cart:a") == {"apple": "2", "pear": "1"}
        assert direct.get("cart:b") == "one melon"
        assert direct.execute_command("PEXPIRETIME", "cart:b") == expiry
        assert sorted(direct.keys("*art*")) == ["Cart Items", "Cart-a", "Cart-b", "cart:a", "cart:b"]
    finally:
        direct.delete("Cart-a", "Cart-b", "cart:a", "cart:b")


# --- Sentinel -----------------------------------------------------------------------------------

class Sentinel:
    """One Sentinel that monitors `primary_port` as MASTER; `conf` is added to its config file."""

    def __init__(self, primary_port, conf=""):
        self.dir = tempfile.mkdtemp(prefix="kg-sentinel-")

        def start():
            self.port = free_port()
            path = write(self.dir, "sentinel.conf",
                         (conf + "\n").replace("{port}", str(self.port)) +
                         "bind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %d 1\n" % (self.dir, MASTER, primary_port))
            if "tls-port" not in conf:
                with open(path, "a") as f:
                    f.write("port %d\n" % self.port)
            log, out = output_file()
            with out:
                self.proc = subprocess.Popen(["redis-server", path, "--sentinel"], stdout=out, stderr=subprocess.STDOUT)
            return self.proc, file_output(log), [self.port]

        start_listening("redis-sentinel", start)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def test_audit_through_a_sentinel_group_reaches_the_primary_with_the_configured_credentials():
    """The first Sentinel listed is down, the second names the primary; the Sentinel and the
    primary each want their own password (sentinel.password_file, upstream_auth.password_file)."""
    primary = Redis("--requirepass", "primary-secret")
    sentinel = Sentinel(primary.port, "requirepass sentinel-secret\nsentinel auth-pass %s primary-secret" % MASTER)
    d = tempfile.mkdtemp(prefix="kg-maint-sentinel-")
    try:
        fill(redis.Redis(port=primary.port, password="primary-secret"))
        down = free_port()
        url = "redis-sentinel://%s@127.0.0.1:%d,127.0.0.1:%d" % (MASTER, down, sentinel.port)
        auth = "upstream_auth:\n  password_file: %s\n" % write(d, "primary-password", "primary-secret\n")
        with_sentinel_auth = "sentinel:\n  password_file: %s\n" % write(d, "sentinel-password", "sentinel-secret\n")
        config = write(d, "kg.yaml", "upstream: %s\n%s%s%s" % (url, auth, with_sentinel_auth, RULES))
        check_audit(run("audit", config, "--format", "json", "--no-progress"),
                    "%s primary 127.0.0.1:%d" % (url, primary.port))

        # Without the Sentinel's password, and with no Sentinel up: every one named with its reason.
        config = write(d, "no-sentinel-auth.yaml", "upstream: %s\n%s%s" % (url, auth, RULES))
        p = run("audit", config, "--no-progress")
        assert (p.returncode, p.stdout) == (2, ""), p.stderr
        assert p.stderr == ("keyguard audit: upstream %s: no Sentinel gave a verified master: Sentinel 127.0.0.1:%d: "
                            "Connection refused; Sentinel 127.0.0.1:%d: NOAUTH Authentication required.\n"
                            % (url, down, sentinel.port))
        others = "redis-sentinel://%s@127.0.0.1:%d,127.0.0.1:%d" % (MASTER, down, down + 1 if down < 65535 else 1)
        p = run("audit", config, "--upstream", others, "--no-progress")
        assert p.returncode == 2 and p.stderr.startswith(
            "keyguard audit: upstream %s: no Sentinel gave a verified master: Sentinel 127.0.0.1:%d: Connection refused; "
            % (others, down)), p.stderr
    finally:
        sentinel.stop()
        primary.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_audit_through_a_tls_sentinel_group(tls):
    """rediss-sentinel://: the Sentinel and the primary both over TLS, with upstream_tls (as the
    proxy reaches them)."""
    server, pki, _ = tls
    sentinel = Sentinel(server.port, "port 0\ntls-port {port}\ntls-cert-file %s\ntls-key-file %s\n"
                        "tls-ca-cert-file %s\ntls-auth-clients no\ntls-replication yes"
                        % (pki("server.crt"), pki("server.key"), pki("ca.crt")))
    try:
        url = "rediss-sentinel://%s@127.0.0.1:%d" % (MASTER, sentinel.port)
        config = tls_config(pki, url, client_tls(pki))
        check_audit(run("audit", config, "--format", "json", "--no-progress"),
                    "%s primary 127.0.0.1:%d" % (url, server.port))
    finally:
        sentinel.stop()
