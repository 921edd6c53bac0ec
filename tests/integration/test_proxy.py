"""Through keyguard against a real redis-server, with real clients (redis-py, redis-cli and a raw
RESP socket for exact bytes). Many tests are differential: the same bytes sent to redis-server
directly and through keyguard must get the same bytes back."""
import os
import socket
import subprocess
import threading
import time

import pytest
import redis

from conftest import CLUSTER_MODE, SANITIZED, Keyguard, Redis, blocked_clients, wait_blocked, wait_until
from resp import Closed, Push, RespConn, encode


def split_first(raw):
    """Parses the first reply in `raw`; returns it and the bytes after it."""
    c = RespConn.__new__(RespConn)
    c.sock, c.buf = None, raw
    v, _ = c.read()
    return v, c.buf


def direct_and_proxied(redis_server, keyguard, data, replies=0, closed=False):
    """The same bytes sent directly and through keyguard; each side reads `replies` replies (and
    until closed with closed=True), see RespConn.exchange."""
    a = RespConn(redis_server.port)
    b = RespConn(keyguard.port)
    try:
        return a.exchange(data, replies, closed), b.exchange(data, replies, closed)
    finally:
        a.close()
        b.close()


# --- plain traffic --------------------------------------------------------------------------

def test_redis_py_ten_thousand_pipelined_commands(fresh, keyguard):
    r = redis.Redis(port=keyguard.port)
    p = r.pipeline(transaction=False)
    for i in range(10000):
        if i % 3 == 0:
            p.set("k:%d" % i, "v%d" % i)
        elif i % 3 == 1:
            p.get("k:%d" % (i - 1))
        else:
            p.incr("counter")
    out = p.execute()
    expected = []
    n = 0
    for i in range(10000):
        if i % 3 == 0:
            expected.append(True)
        elif i % 3 == 1:
            expected.append(b"v%d" % (i - 1))
        else:
            n += 1
            expected.append(n)
    assert out == expected
    assert redis.Redis(port=fresh.port).get("k:9999") == b"v9999"


def test_redis_cli_through_keyguard(fresh, keyguard):
    def cli(*args):
        return subprocess.run(["redis-cli", "-p", str(keyguard.port), *args], capture_output=True, text=True,
                              check=True).stdout
    assert cli("SET", "user:1:name", "ada") == "OK\n"
    assert cli("GET", "user:1:name") == "ada\n"
    assert cli("RPUSH", "l", "a", "b") == "2\n"
    assert cli("LRANGE", "l", "0", "-1") == "a\nb\n"
    out = subprocess.run(["redis-cli", "-p", str(keyguard.port)], input="SET x 1\nINCR x\nGET x\n",
                         capture_output=True, text=True, check=True).stdout
    assert out == "OK\n2\n2\n"


def test_inline_commands(fresh, keyguard):
    d, p = direct_and_proxied(fresh, keyguard, b'PING\r\nSET k "a b"\r\nGET k\r\n\r\nECHO \'x y\'\n',
                              replies=4)
    assert p == b"+PONG\r\n+OK\r\n$3\r\na b\r\n$3\r\nx y\r\n"
    assert p == d


def test_binary_safe_and_empty_values(fresh, keyguard):
    r = redis.Redis(port=keyguard.port)
    key = b"\x00k\r\n\xff"
    val = bytes(range(256)) + b"\r\n*1\r\n$4\r\nPING\r\n"
    r.set(key, val)
    r.set(b"", b"")
    assert r.get(key) == val
    assert r.get(b"") == b""
    assert sorted(redis.Redis(port=fresh.port).keys("*")) == sorted([key, b""])


@pytest.mark.not_cluster(reason="SELECT 3: a cluster serves database 0 only ('SELECT is not allowed in cluster mode', as on a cluster node)")
def test_select(fresh, keyguard):
    r = redis.Redis(port=keyguard.port, db=3)
    r.set("k", "in-db-3")
    assert redis.Redis(port=fresh.port, db=3).get("k") == b"in-db-3"
    assert redis.Redis(port=fresh.port, db=0).get("k") is None
    c = RespConn(keyguard.port)
    assert c.call("SELECT", "3") == "OK"
    assert c.call("GET", "k") == b"in-db-3"
    assert c.call("SELECT", "0") == "OK"
    assert c.call("GET", "k") is None


def test_multi_exec_and_aborted_watch(fresh, keyguard):
    r = redis.Redis(port=keyguard.port)
    other = redis.Redis(port=keyguard.port)
    r.set("balance", 10)
    with r.pipeline() as p:
        p.watch("balance")
        p.multi()
        p.incrby("balance", 5)
        p.get("balance")
        assert p.execute() == [15, b"15"]
    with r.pipeline() as p:
        p.watch("balance")
        other.set("balance", 100)  # a racing writer
        p.multi()
        p.incrby("balance", 5)
        with pytest.raises(redis.WatchError):
            p.execute()
    assert r.get("balance") == b"100"
    # The same bytes give the same replies directly and through keyguard, EXECABORT included.
    data = encode("MULTI") + encode("SET", "a", "1") + encode("INCR", "a", "extra") + encode("EXEC") + \
        encode("MULTI") + encode("NOSUCHCMD") + encode("EXEC") + encode("EXEC") + encode("DISCARD")
    d, p = direct_and_proxied(fresh, keyguard, data, replies=9)
    assert p == d
    assert b"-EXECABORT" in p


def test_blpop_served_by_later_lpush(fresh, keyguard):
    result = {}

    def waiter():
        result["v"] = redis.Redis(port=keyguard.port).blpop("jobs", timeout=5)

    t = threading.Thread(target=waiter)
    t.start()
    wait_blocked(fresh.port)  # the BLPOP has reached the server and blocks there
    assert "v" not in result
    redis.Redis(port=keyguard.port).lpush("jobs", "job-1")
    t.join(60)
    assert result["v"] == (b"jobs", b"job-1")


# --- pub/sub, RESP3, pushes -----------------------------------------------------------------

def test_subscribe_resp2(fresh, keyguard):
    c = RespConn(keyguard.port)
    c.send_raw(encode("SUBSCRIBE", "news", "sport") + encode("PSUBSCRIBE", "user:*"))
    assert [c.value() for _ in range(3)] == [[b"subscribe", b"news", 1], [b"subscribe", b"sport", 2],
                                            [b"psubscribe", b"user:*", 3]]
    pub = redis.Redis(port=keyguard.port)
    assert pub.publish("news", "hello") == 1
    assert pub.publish("user:7", "hi 7") == 1
    assert c.read() == ([b"message", b"news", b"hello"],
                        b"*3\r\n$7\r\nmessage\r\n$4\r\nnews\r\n$5\r\nhello\r\n")
    assert c.value() == [b"pmessage", b"user:*", b"user:7", b"hi 7"]
    assert c.call("PING") == [b"pong", b""]
    c.send_raw(encode("UNSUBSCRIBE") + encode("PUNSUBSCRIBE"))
    vals = [c.value() for _ in range(2)]
    assert [v[0] for v in vals] == [b"unsubscribe"] * 2 and [v[2] for v in vals] == [2, 1]
    assert sorted(v[1] for v in vals) == [b"news", b"sport"]
    assert c.value() == [b"punsubscribe", b"user:*", 0]
    # Out of subscribe mode: a reply that looks like a message is a plain reply again.
    pub.rpush("l", "message", "x", "y")
    assert c.call("LRANGE", "l", "0", "-1") == [b"message", b"x", b"y"]
    # The same subscribe-mode conversation, byte for byte.
    data = encode("SUBSCRIBE", "a", "b") + encode("PING") + encode("PING", "x") + encode("UNSUBSCRIBE", "a") + \
        encode("UNSUBSCRIBE") + encode("UNSUBSCRIBE") + encode("GET", "l")
    d, p = direct_and_proxied(fresh, keyguard, data, replies=8)
    assert p == d


def test_subscribe_resp3_with_commands_in_between(fresh, keyguard):
    c = RespConn(keyguard.port)
    hello = c.call("HELLO", "3")
    assert hello[b"proto"] == 3 and hello[b"server"] == b"redis"
    c.send_raw(encode("SUBSCRIBE", "ch") + encode("SET", "k", "v"))
    assert c.read() == (Push([b"subscribe", b"ch", 1]), b">3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n")
    assert c.value() == "OK"
    redis.Redis(port=keyguard.port).publish("ch", "m1")
    assert c.value() == Push([b"message", b"ch", b"m1"])
    assert c.call("GET", "k") == b"v"  # RESP3 allows commands in subscribe mode
    c.send_raw(encode("UNSUBSCRIBE", "ch") + encode("GET", "k"))
    assert c.value() == Push([b"unsubscribe", b"ch", 0])
    assert c.value() == b"v"


def test_hello3_every_resp3_type_byte_for_byte(fresh, keyguard):
    data = encode("HELLO", "3") + b"".join(encode("DEBUG", "PROTOCOL", t) for t in [
        "string", "integer", "double", "bignum", "null", "array", "set", "map", "attrib", "push", "verbatim",
        "true", "false"]) + encode("PING")
    # HELLO, 13 DEBUG PROTOCOL replies (push is a push frame and then a reply), PING.
    d, p = direct_and_proxied(fresh, keyguard, data, replies=16)
    # The HELLO map holds each connection's client id; compare everything after it exactly.
    hello_d, rest_d = split_first(d)
    hello_p, rest_p = split_first(p)
    assert hello_d[b"proto"] == 3 and hello_p[b"proto"] == 3
    assert rest_p == rest_d
    for marker in [b"(1234567999999999999999999999999999999", b"~3\r\n", b"%3\r\n", b"|1\r\n", b">2\r\n",
                   b"=", b"#t\r\n", b"#f\r\n", b",3.14", b"_\r\n"]:
        assert marker in rest_p, marker
    assert rest_p.endswith(b"+PONG\r\n")


def test_sharded_pubsub_and_local_reply_after_subscribe(fresh, keyguard):
    c = RespConn(keyguard.port)
    # The refused FLUSHALL's error must come after SUBSCRIBE's confirmations, not before.
    out = c.exchange(encode("SSUBSCRIBE", "s1") + encode("SUBSCRIBE", "c1", "c2") + encode("FLUSHALL"), replies=4)
    assert out == b"*3\r\n$10\r\nssubscribe\r\n$2\r\ns1\r\n:1\r\n" \
                  b"*3\r\n$9\r\nsubscribe\r\n$2\r\nc1\r\n:1\r\n*3\r\n$9\r\nsubscribe\r\n$2\r\nc2\r\n:2\r\n" \
                  b"-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n"
    assert redis.Redis(port=keyguard.port).execute_command("SPUBLISH", "s1", "sharded") == 1
    assert c.value() == [b"smessage", b"s1", b"sharded"]
    c.send_raw(encode("SUNSUBSCRIBE") + encode("PING"))
    assert c.value() == [b"sunsubscribe", b"s1", 0]
    assert c.value() == [b"pong", b""]


def test_hello_switches_back_to_resp2(fresh, keyguard):
    c = RespConn(keyguard.port)
    assert c.call("HELLO", "3")[b"proto"] == 3
    hello2 = c.call("HELLO", "2")  # a flat array in RESP2
    assert hello2[hello2.index(b"proto") + 1] == 2
    c.send_raw(encode("SUBSCRIBE", "x"))
    assert c.read()[1] == b"*3\r\n$9\r\nsubscribe\r\n$1\r\nx\r\n:1\r\n"
    redis.Redis(port=keyguard.port).publish("x", "m")
    assert c.value() == [b"message", b"x", b"m"]


def test_client_tracking_invalidation_push_resp3(fresh, keyguard):
    c = RespConn(keyguard.port)
    c.call("HELLO", "3")
    assert c.call("CLIENT", "TRACKING", "ON") == "OK"
    assert c.call("GET", "tracked") is None
    redis.Redis(port=keyguard.port).set("tracked", "new")
    assert c.read() == (Push([b"invalidate", [b"tracked"]]),
                        b">2\r\n$10\r\ninvalidate\r\n*1\r\n$7\r\ntracked\r\n")
    assert c.call("GET", "tracked") == b"new"


def test_client_tracking_redirect_resp2(fresh, keyguard):
    sink = RespConn(keyguard.port)
    sink_id = sink.call("CLIENT", "ID")
    sink.send("SUBSCRIBE", "__redis__:invalidate")
    assert sink.value() == [b"subscribe", b"__redis__:invalidate", 1]
    c = RespConn(keyguard.port)
    if CLUSTER_MODE:
        # CLIENT ID answered keyguard's shared connection's id (a cluster client is not pinned for
        # it): a redirect there would lose every invalidation, so it is refused.
        refused = c.call("CLIENT", "TRACKING", "ON", "REDIRECT", sink_id)
        assert str(refused).startswith("ERR keyguard: CLIENT TRACKING REDIRECT is not served through a Redis "
                                       "Cluster upstream"), refused
        assert c.call("GET", "t2") is None
        return
    assert c.call("CLIENT", "TRACKING", "ON", "REDIRECT", sink_id) == "OK"
    assert c.call("GET", "t2") is None
    redis.Redis(port=keyguard.port).set("t2", "x")
    assert sink.value() == [b"message", b"__redis__:invalidate", [b"t2"]]


def test_monitor(fresh, keyguard):
    m = RespConn(keyguard.port)
    assert m.call("MONITOR") == "OK"
    redis.Redis(port=keyguard.port).set("watched", "1")
    line = m.value()
    assert line.split("] ", 1)[1] == '"SET" "watched" "1"', line
    # A command on the monitoring connection still gets its own reply in order.
    m.send("PING")
    v = m.value()
    while v != "PONG":
        assert '"' in v  # only monitor lines may come first
        v = m.value()


def test_client_reply_off_and_skip(fresh, keyguard):
    data = encode("CLIENT", "REPLY", "OFF") + encode("SET", "a", "1") + encode("CLIENT", "REPLY", "ON") + \
        encode("GET", "a") + encode("CLIENT", "REPLY", "SKIP") + encode("SET", "b", "2") + encode("GET", "b") + \
        encode("CLIENT", "REPLY", "SKIP") + encode("FLUSHALL") + encode("GET", "a")
    p = RespConn(keyguard.port).exchange(data, replies=4)
    # FLUSHALL is denied by keyguard here; under SKIP even its error is suppressed, as Redis would.
    assert p == b"+OK\r\n$1\r\n1\r\n$1\r\n2\r\n$1\r\n1\r\n"


def test_reset_leaves_subscribe_mode_and_resp3(fresh, keyguard):
    c = RespConn(keyguard.port)
    c.call("HELLO", "3")
    c.send("SUBSCRIBE", "r")
    assert c.value() == Push([b"subscribe", b"r", 1])
    assert c.call("RESET") == "RESET"
    c.send("SUBSCRIBE", "r2")
    assert c.read()[1] == b"*3\r\n$9\r\nsubscribe\r\n$2\r\nr2\r\n:1\r\n"  # RESP2 again
    assert c.call("RESET") == "RESET"
    assert c.call("SET", "z", "1") == "OK"


def test_quit(fresh, keyguard):
    c = RespConn(keyguard.port)
    assert c.exchange(encode("SET", "q", "1") + encode("QUIT") + encode("SET", "q", "2"), closed=True) == \
        b"+OK\r\n+OK\r\n<closed>"
    assert redis.Redis(port=fresh.port).get("q") == b"1"


def test_quit_and_reset_inside_multi(fresh, keyguard):
    d, p = direct_and_proxied(fresh, keyguard, encode("MULTI") + encode("SET", "t", "1") + encode("RESET") +
                              encode("EXEC") + encode("MULTI") + encode("QUIT") + encode("PING"), closed=True)
    assert p == d
    assert p == b"+OK\r\n+QUEUED\r\n+RESET\r\n-ERR EXEC without MULTI\r\n+OK\r\n+OK\r\n<closed>"


def test_auth_with_acl_user(fresh, keyguard):
    admin = redis.Redis(port=fresh.port)
    admin.execute_command("ACL", "SETUSER", "app", "on", ">app-pw", "~app:*", "+@all")
    try:
        r = redis.Redis(port=keyguard.port, username="app", password="app-pw")
        assert r.set("app:1", "v")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("other:1", "v")
        data = encode("AUTH", "app", "wrong") + encode("AUTH", "app", "app-pw") + encode("SET", "other:2", "x") + \
            encode("ACL", "WHOAMI")
        d, p = direct_and_proxied(fresh, keyguard, data, replies=4)
        assert p == d
        assert p.startswith(b"-WRONGPASS")
        assert b"$3\r\napp\r\n" in p
    finally:
        admin.execute_command("ACL", "DELUSER", "app")


# --- keyguard's own replies in the pipeline ------------------------------------------------------

def test_denied_command_mid_pipeline_gets_its_error_in_place(fresh, keyguard):
    before = keyguard.metric('keyguard_commands_total{command="flushall",outcome="rejected"}')
    c = RespConn(keyguard.port)
    out = c.exchange(encode("SET", "a", "1") + encode("FLUSHALL") + encode("GET", "a") + encode("flushall", "async"),
                     replies=4)
    assert out == b"+OK\r\n-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n$1\r\n1\r\n" \
                  b"-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n"
    assert redis.Redis(port=fresh.port).get("a") == b"1"
    assert keyguard.metric('keyguard_commands_total{command="flushall",outcome="rejected"}') == before + 2


def test_denied_command_inside_multi_aborts_exec(fresh, keyguard):
    c = RespConn(keyguard.port)
    out = c.exchange(encode("MULTI") + encode("SET", "m", "1") + encode("FLUSHALL") + encode("EXEC") +
                     encode("GET", "m"), replies=5)
    assert out == b"+OK\r\n+QUEUED\r\n-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n" \
                  b"-EXECABORT Transaction discarded because of previous errors.\r\n$-1\r\n"
    assert redis.Redis(port=fresh.port).get("m") is None


# --- malformed input ------------------------------------------------------------------------

MALFORMED = [
    b"*abc\r\n",
    b"*2\r\n$3\r\nGET\r\nx\r\n",
    b"*1\r\n$-5\r\n",
    b"*1\r\n$abc\r\n",
    b'SET "a b\r\n',
    b"SET 'a'b c\r\n",
    b"*3000000000\r\n",
    b"*1\r\n$600000000\r\n",
    b"PING\r\n*1\r\n+x\r\n",
    b"x" * 70000,
    b"*1\r\n$" + b"1" * 70000,
    b"*" + b"1" * 70000,
]


@pytest.mark.parametrize("data", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_input_gets_redis_error_then_close(fresh, keyguard, data):
    before = keyguard.metric("keyguard_client_protocol_errors_total")
    d, p = direct_and_proxied(fresh, keyguard, data, closed=True)
    assert p == d
    assert b"-ERR Protocol error: " in p and p.endswith(b"<closed>")
    assert keyguard.metric("keyguard_client_protocol_errors_total") == before + 1


# --- failures -----------------------------------------------------------------------------

@pytest.mark.dedicated_only(reason="the shared and idle upstream connections stay open when the client goes")
def test_client_killed_mid_pipeline(redis_server):
    kg = Keyguard(redis_server.port)  # its own instance: the connection gauges start at 0
    try:
        c = RespConn(kg.port)
        c.send_raw(b"".join(encode("SET", "kill:%d" % i, "x" * 100) for i in range(20000)))
        c.sock.close()  # gone without reading a reply
        wait_until(lambda: kg.metric("keyguard_client_connections") == 0, "the client connection to close")
        assert kg.metric("keyguard_upstream_connections") == 0
        assert redis.Redis(port=kg.port).ping()
    finally:
        assert kg.stop() == 0


def test_a_client_that_hangs_up_behind_a_blocked_command_frees_it():
    """The server frees a blocked client when it reads the end of its stream. keyguard stops
    reading a client after QUIT or a protocol error, and while the replies it owes are at
    max_pending_commands: a client that hung up there was not seen, and its BLPOP stayed blocked
    on the server, holding a connection and taking the next value pushed for nobody. Now a client
    that is not read, hung up and got nothing for a second is closed, and its upstream connection
    with it; the value pushed afterwards stays in the list."""
    r = Redis()
    kg = Keyguard(r.port, config="limits: {max_pending_commands: 2}\n")
    direct = redis.Redis(port=r.port)
    try:
        for tail in (encode("QUIT"), b"*x\r\n", encode("GET", "a") + encode("GET", "b") + encode("GET", "c")):
            c = RespConn(kg.port)
            c.send_raw(encode("BLPOP", "jobs", "0") + tail)
            wait_blocked(r.port)
            c.sock.close()
            wait_until(lambda: blocked_clients(r.port) == 0, "the hung-up client's BLPOP to end")
            assert direct.rpush("jobs", "j1") == 1
            assert direct.lrange("jobs", 0, -1) == [b"j1"]
            assert direct.delete("jobs") == 1
        # A client that half-closes after commands that are answered gets every reply, however
        # long the server takes (here, longer than the second keyguard waits behind a BLPOP).
        c = RespConn(kg.port)
        c.send_raw(encode("SET", "k", "v") + encode("DEBUG", "SLEEP", "2.5") + encode("GET", "k") + encode("QUIT"))
        c.sock.shutdown(socket.SHUT_WR)
        assert c.read_until_closed() == b"+OK\r\n+OK\r\n$1\r\nv\r\n+OK\r\n"
    finally:
        direct.close()
        assert kg.stop() == 0
        r.stop()


def test_connections_pinned_or_reset_after_a_password_rotation_use_the_new_secret():
    """keyguard AUTHs each upstream connection it makes with the password file's current secret.
    A client's session kept the secret it started with for the connections it made later: a
    connection pinned for it after a rotation (shared: the pool empty; a cluster: every pin is
    new), and the AUTH keyguard sends again after a client's RESET, were refused by the server."""
    r = Redis("--requirepass", "pw-1")
    pw = os.path.join(r.dir, "pw")

    def write_password(text):
        with open(pw + ".new", "w") as f:  # as a Secret update: the new file renamed into place
            f.write(text + "\n")
        os.rename(pw + ".new", pw)

    write_password("pw-1")
    kg = Keyguard(r.port, config='upstream_auth: {password_file: "%s"}\npinned_idle_connections: 0\n' % pw)
    direct = redis.Redis(port=r.port, password="pw-1")
    try:
        c = RespConn(kg.port)
        assert c.call("SET", "k", "1") == "OK"
        assert direct.config_set("requirepass", "pw-2") is True
        write_password("pw-2")
        c.send_raw(encode("MULTI") + encode("INCR", "k") + encode("EXEC"))
        assert [c.read()[1] for _ in range(3)] == [b"+OK\r\n", b"+QUEUED\r\n", b"*1\r\n:2\r\n"]
        assert c.call("RESET") == "RESET"
        assert c.call("INCR", "k") == 3
        assert kg.metric('keyguard_upstream_errors_total{reason="auth"}') == 0
        assert redis.Redis(port=r.port, password="pw-2").get("k") == b"3"
        c.close()
    finally:
        direct.close()
        assert kg.stop() == 0, kg.output()
        r.stop()


@pytest.mark.dedicated_only(reason="the client stays connected (its commands in flight fail) and the error is counted once per shared connection")
def test_upstream_killed_mid_pipeline():
    r = Redis()
    kg = Keyguard(r.port)
    try:
        c = RespConn(kg.port)
        assert c.call("SET", "a", "1") == "OK"
        c.send_raw(encode("BLPOP", "never", "0") + encode("GET", "a") + encode("PING"))
        wait_blocked(r.port)  # BLPOP blocks in the server, GET and PING wait behind it
        r.stop(sig=9)
        assert c.read_until_closed() == b"-ERR keyguard: upstream unavailable\r\n" * 3
        assert kg.metric('keyguard_upstream_errors_total{reason="closed"}') + \
            kg.metric('keyguard_upstream_errors_total{reason="reset"}') == 1
        assert kg.metric('keyguard_commands_total{command="get",outcome="failed"}') == 1
        status, body = kg.http("/readyz")
        assert status == 503 and "unreachable" in body
    finally:
        assert kg.stop() == 0
        r.stop()


@pytest.mark.dedicated_only(reason="the client stays connected, and the shared connections count a connect error at each retry")
def test_upstream_down_at_connect():
    kg = Keyguard(upstream_port=1)  # nothing listens on port 1
    try:
        # The fixture's readiness probe was one connection too, and fails to connect upstream
        # once: wait for that before counting ours.
        wait_until(lambda: kg.metric('keyguard_upstream_errors_total{reason="connect"}') >= 1,
                   "the readiness probe's connect failure")
        before = kg.metric('keyguard_upstream_errors_total{reason="connect"}')
        assert before == 1
        c = RespConn(kg.port)
        assert c.exchange(encode("PING"), closed=True) == b"-ERR keyguard: upstream unavailable\r\n<closed>"
        assert kg.metric('keyguard_upstream_errors_total{reason="connect"}') == before + 1
        assert kg.http("/healthz") == (200, "ok\n")
        assert kg.http("/readyz")[0] == 503
    finally:
        assert kg.stop() == 0


def test_sigterm_drains_in_flight_replies(redis_server):
    # A drain timeout no slow machine reaches: the pending reply, not the clock, ends the drain.
    kg = Keyguard(redis_server.port, config="drain_timeout_ms: 600000\n")
    c = RespConn(kg.port)
    c.send("BLPOP", "drain-q", "0")
    wait_blocked(redis_server.port)
    kg.proc.send_signal(15)
    wait_until(lambda: "draining" in kg.output(), "keyguard to log that it drains")

    def refused():
        try:
            RespConn(kg.port, timeout=5).close()
            return False
        except OSError:
            return True
    wait_until(refused, "the listener to close")  # no longer accepting
    assert kg.proc.poll() is None  # still draining: a reply is pending
    redis.Redis(port=redis_server.port).rpush("drain-q", "last")
    assert c.value() == [b"drain-q", b"last"]
    assert kg.proc.wait(60) == 0
    assert kg.events("draining") == [{"level": "info", "event": "draining", "signal": 15, "drain_timeout_ms": 600000}]


def test_sigterm_drain_timeout_closes_stuck_clients(redis_server):
    kg = Keyguard(redis_server.port, config="drain_timeout_ms: 1000\n")
    c = RespConn(kg.port)
    c.send("BLPOP", "never-q", "0")
    wait_blocked(redis_server.port)
    start = time.monotonic()
    # A stuck client holds the exit for the drain timeout (a lower bound no slow machine breaks),
    # then is closed; stop() fails if keyguard is still there after a generous bound.
    assert kg.stop() == 0
    assert time.monotonic() - start >= 1.0
    with pytest.raises((Closed, ConnectionResetError)):
        c.value()


@pytest.mark.dedicated_only(reason="a client that reads nothing for a second is closed rather than holding up the others on its connection")
@pytest.mark.skipif(SANITIZED, reason="ASan quarantine inflates RSS; the release pass checks the bound")
def test_slow_reader_keeps_memory_bounded():
    r = Redis()
    kg = Keyguard(r.port, threads=1)
    try:
        big = b"v" * (10 << 20)
        redis.Redis(port=r.port).set("big", big)
        c = RespConn(kg.port)
        c.sock.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_RCVBUF, 65536)
        base = kg.rss_kb()
        c.send_raw(encode("GET", "big") * 60)  # 600 MB of replies, never read
        peak = 0
        for _ in range(30):
            time.sleep(0.1)
            peak = max(peak, kg.rss_kb())
        growth_mb = (peak - base) / 1024
        print("\nslow reader: 60 pipelined GETs of a 10 MB value, keyguard RSS %.1f MB -> peak %.1f MB (+%.1f MB)"
              % (base / 1024, peak / 1024, growth_mb))
        # One 10 MB reply in the read buffer plus at most one in the output backlog, whatever the
        # number of pipelined GETs.
        assert growth_mb < 40, growth_mb
        # Once the client reads, every reply arrives intact.
        for _ in range(60):
            v, _ = c.read()
            assert len(v) == len(big)
    finally:
        kg.stop()
        r.stop()
