"""A tenant's FLUSHALL/FLUSHDB, DBSIZE and RANDOMKEY walk the tenant's keys in bounded steps
(issue #12: one server-side walk over all keys blocked every tenant), each step one EVAL of a SCAN
of walk_step_keys keys, at most walk_steps_per_second steps a second per tenant. Checked on a real
redis-server: exact answers, the other tenant's keys untouched, the steps the server ran (MONITOR
on a direct connection), replies in order behind a pipelined walk, and the refusals where a walk
cannot run (inside MULTI, under CLIENT REPLY OFF/SKIP)."""
import contextlib
import os
import re
import socket
import ssl
import threading
import time

import pytest
import redis

from conftest import ROOT, Keyguard, Redis, wait_until
from resp import RespConn, encode
from test_tls import make_ca, make_cert

STEP_KEYS = 100
CONFIG = open(os.path.join(ROOT, "examples", "tenants.yaml")).read().replace(
    "tenancy:", "tenancy:\n  walk_step_keys: %d\n  walk_steps_per_second: 0" % STEP_KEYS, 1)
SLOW = CONFIG.replace("walk_steps_per_second: 0", "walk_steps_per_second: 20")
ALICE_KEYS, BOB_KEYS = 2500, 1500


@pytest.fixture(scope="module")
def stack():
    """One redis-server and one keyguard with the walk settings in front of it."""
    r = Redis()
    k = Keyguard(r.port, config=CONFIG)
    yield r, k
    assert k.stop() == 0, k.output()
    r.stop()


@pytest.fixture(scope="module")
def server(stack):
    return stack[0]


@pytest.fixture(scope="module")
def kg(stack):
    return stack[1]


@pytest.fixture
def direct(server):
    d = redis.Redis(port=server.port, decode_responses=True)
    d.flushall()
    pipe = d.pipeline(transaction=False)
    for i in range(ALICE_KEYS):
        pipe.set("tenant:a:k%d" % i, i)
    for i in range(BOB_KEYS):
        pipe.set("tenant:b:k%d" % i, i)
    pipe.execute()
    return d


def as_user(port, user):
    return redis.Redis(port=port, username=user, password=user + "-secret", decode_responses=True)


class Monitor:
    """The EVALs the server runs, from a MONITOR on a direct connection."""

    def __init__(self, port):
        self.conn = redis.Redis(port=port, decode_responses=True).connection_pool.get_connection("MONITOR")
        self.conn.send_command("MONITOR")
        assert self.conn.read_response() in ("OK", b"OK")
        self.lines = []

    def collect_until(self, marker):
        """Reads MONITOR lines up to the one holding `marker` (a PING sent afterwards)."""
        while True:
            line = self.conn.read_response()
            line = line.decode() if isinstance(line, bytes) else line
            if marker in line:
                return
            self.lines.append(line)

    def steps(self, walk):
        return [l for l in self.lines if '"EVAL"' in l and '"%s"' % walk in l]

    def close(self):
        self.conn.disconnect()


def test_dbsize_randomkey_flush_walk_in_steps_and_stay_inside_the_tenant(kg, server, direct):
    mon = Monitor(server.port)
    alice = as_user(kg.port, "alice")
    assert alice.dbsize() == ALICE_KEYS
    key = alice.randomkey()
    assert key.startswith("k") and direct.exists("tenant:a:" + key)
    assert alice.flushdb() is True
    direct.echo("end-of-walks")
    mon.collect_until("end-of-walks")
    mon.close()
    assert direct.keys("tenant:a:*") == [] and direct.dbsize() == BOB_KEYS
    assert as_user(kg.port, "bob").dbsize() == BOB_KEYS
    # DBSIZE and FLUSHDB each took at least ALICE_KEYS / STEP_KEYS steps, every one a SCAN of
    # STEP_KEYS keys under alice's prefix.
    for walk in ("dbsize", "flush"):
        steps = mon.steps(walk)
        assert len(steps) >= ALICE_KEYS // STEP_KEYS, (walk, len(steps))
        assert all('"tenant:a:*" "tenant:a:"' in s and ' "%d" ' % STEP_KEYS in s for s in steps), steps[:2]
        assert [s.rsplit('"', 2)[-2] for s in steps] == [str(i) for i in range(len(steps))]  # step numbers
    assert 1 <= len(mon.steps("randomkey")) <= 2
    assert alice.dbsize() == 0 and alice.randomkey() is None


def test_pipelined_commands_wait_for_the_walk_and_keep_their_order(kg, direct):
    c = RespConn(kg.port)
    assert c.call("AUTH", "alice", "alice-secret") == "OK"
    out = c.exchange(encode("SET", "x", "1") + encode("DBSIZE") + encode("GET", "x") + encode("DEL", "x") +
                     encode("DBSIZE") + encode("RANDOMKEY") + encode("PING"), replies=7)
    m = re.fullmatch(rb"\+OK\r\n:%d\r\n\$1\r\n1\r\n:1\r\n:%d\r\n\$\d+\r\n(k\d+)\r\n\+PONG\r\n"
                     % (ALICE_KEYS + 1, ALICE_KEYS), out)
    assert m and direct.exists("tenant:a:" + m.group(1).decode()), out
    # RESP3: an empty tenant's RANDOMKEY is the RESP3 null.
    c3 = RespConn(kg.port)
    assert isinstance(c3.call("HELLO", "3", "AUTH", "bob", "bob-secret"), dict)
    assert c3.call("FLUSHALL", "ASYNC") == "OK"
    assert c3.exchange(encode("RANDOMKEY") + encode("DBSIZE"), replies=2) == b"_\r\n:0\r\n"
    assert direct.dbsize() == ALICE_KEYS


def test_a_walk_cannot_be_queued_or_silenced(kg, direct):
    c = RespConn(kg.port)
    assert c.call("AUTH", "alice", "alice-secret") == "OK"
    assert c.call("MULTI") == "OK"
    assert str(c.call("FLUSHDB")) == ("ERR keyguard: FLUSHDB inside MULTI or under CLIENT REPLY OFF/SKIP is not "
                                      "allowed for tenants (keyguard walks the tenant's keys in steps)")
    assert str(c.call("EXEC")) == "EXECABORT Transaction discarded because of previous errors."
    # Under CLIENT REPLY OFF the refusal is silent too; nothing is flushed.
    out = c.exchange(encode("CLIENT", "REPLY", "OFF") + encode("FLUSHALL") + encode("CLIENT", "REPLY", "ON") +
                     encode("DBSIZE"), replies=2)
    assert out == b"+OK\r\n:%d\r\n" % ALICE_KEYS
    assert direct.dbsize() == ALICE_KEYS + BOB_KEYS


def test_steps_are_rate_limited_per_tenant(server, direct):
    k = Keyguard(server.port, config=SLOW)
    try:
        alice, bob = as_user(k.port, "alice"), as_user(k.port, "bob")
        # 20 steps a second and a one-second burst: 26 steps take at least (26 - 20) / 20 s.
        start = time.monotonic()
        assert alice.dbsize() == ALICE_KEYS
        assert time.monotonic() - start >= (ALICE_KEYS // STEP_KEYS + 1 - 20) / 20.0
        # Meanwhile other clients are served between the steps: bob's budget is his own, and a
        # direct client is never blocked by a walk.
        result = {}

        def walk():
            result["alice"] = alice.dbsize()

        t = threading.Thread(target=walk)
        t.start()
        assert bob.dbsize() == BOB_KEYS
        assert direct.ping()
        t.join()
        assert result["alice"] == ALICE_KEYS
    finally:
        assert k.stop() == 0, k.output()


CRAWL = CONFIG.replace("walk_steps_per_second: 0", "walk_steps_per_second: 5")


def test_a_walks_first_step_takes_a_token_too(server, direct):
    # RANDOMKEY of a tenant holding most keys ends in its first step (the server's RANDOMKEY): a
    # pipeline of them is as many steps, and the rate holds for them as for any other.
    k = Keyguard(server.port, config=SLOW)
    try:
        c = RespConn(k.port)
        assert c.call("AUTH", "alice", "alice-secret") == "OK"
        start = time.monotonic()
        out = c.exchange(encode("RANDOMKEY") * 40 + encode("PING"), replies=41)
        # 20 steps a second and a one-second burst: at least 40 steps take (40 - 20) / 20 s.
        assert time.monotonic() - start >= (40 - 20) / 20.0
        assert out.count(b"$") == 40 and out.endswith(b"+PONG\r\n"), out[-200:]
    finally:
        assert k.stop() == 0, k.output()


def test_drain_serves_the_commands_held_behind_a_walk(server, direct):
    k = Keyguard(server.port, config=CRAWL)
    c = RespConn(k.port)
    assert c.call("AUTH", "alice", "alice-secret") == "OK"
    # 26 steps at 5 a second: SIGTERM comes while the walk runs, SET and GET wait behind it.
    c.send_raw(encode("DBSIZE") + encode("SET", "after", "1") + encode("GET", "after"))
    time.sleep(1.0)
    assert k.stop() == 0, k.output()
    assert c.exchange(b"", closed=True) == b":%d\r\n+OK\r\n$1\r\n1\r\n<closed>" % ALICE_KEYS
    assert direct.get("tenant:a:after") == "1"


def test_a_read_only_walk_stops_when_its_client_hangs_up(server, direct):
    k = Keyguard(server.port, config=CRAWL)
    try:
        def evals():
            return int(direct.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))

        c = RespConn(k.port)
        assert c.call("AUTH", "alice", "alice-secret") == "OK"
        before = evals()
        c.send_raw(encode("DBSIZE"))  # 26 steps at 5 a second
        wait_until(lambda: evals() > before, "the walk to start")
        c.close()
        time.sleep(1.0)  # the step after the close notices it
        stopped = evals()
        time.sleep(1.0)
        assert evals() == stopped and stopped - before < ALICE_KEYS // STEP_KEYS
        # A FLUSH goes on to the end, as the server's would (another client's GET after it
        # must not find the tenant's keys half gone).
        c = RespConn(k.port)
        assert c.call("AUTH", "alice", "alice-secret") == "OK"
        c.send_raw(encode("FLUSHDB"))
        c.close()
        wait_until(lambda: direct.keys("tenant:a:*") == [], "the flush to finish")
        assert direct.dbsize() == BOB_KEYS
    finally:
        assert k.stop() == 0, k.output()


def test_a_walk_stops_when_its_tls_client_hangs_up_with_close_notify(server, direct, tmp_path):
    """Over listen_tls a client's close comes as a close_notify alert and then the FIN: the alert
    bytes in the socket are not a command, so the walk stops as it does for a plain client."""
    d = str(tmp_path)
    make_ca(d, "ca")
    make_cert(d, "server", "ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    k = Keyguard(server.port, config=CRAWL + "listen_tls:\n  cert_file: %s/server.crt\n  key_file: %s/server.key\n"
                 % (d, d))
    try:
        def evals():
            return int(direct.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))

        ctx = ssl.create_default_context(cafile=os.path.join(d, "ca.crt"))
        s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", k.port), timeout=10), server_hostname="localhost")
        s.sendall(encode("AUTH", "alice", "alice-secret"))
        assert s.recv(64) == b"+OK\r\n"
        before = evals()
        s.sendall(encode("DBSIZE"))  # 26 steps at 5 a second
        wait_until(lambda: evals() > before, "the walk to start")
        s.settimeout(0.2)
        with contextlib.suppress(OSError):
            s.unwrap()  # sends close_notify (then waits for keyguard's, which does not come)
        s.close()
        time.sleep(1.0)  # the step after the close notices it
        stopped = evals()
        time.sleep(1.0)
        assert evals() == stopped and stopped - before < ALICE_KEYS // STEP_KEYS
    finally:
        assert k.stop() == 0, k.output()


def test_walk_argument_errors_are_the_servers(kg, server, direct):
    """A walk answers a wrong argument as the server does, and walks nothing."""
    c = RespConn(kg.port)
    assert c.call("AUTH", "alice", "alice-secret") == "OK"
    raw = RespConn(server.port)
    for args in (("DBSIZE", "x"), ("RANDOMKEY", "y"), ("FLUSHALL", "bogus"), ("FLUSHDB", "ASYNC", "x")):
        assert str(c.call(*args)) == str(raw.call(*args)), args
    assert direct.dbsize() == ALICE_KEYS + BOB_KEYS
