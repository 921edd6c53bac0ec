"""Tenant isolation, adversarially: two tenants (alice -> tenant:a:, bob -> tenant:b:) through one
keyguard on one real redis-server. For each command family alice tries to read, write, enumerate,
subscribe to, observe, flush or otherwise reach bob's keys and channels; every test checks the
replies and the server's real state (through a direct connection that bypasses keyguard)."""
import hashlib
import os
import subprocess

import pytest
import redis

from conftest import ROOT, Keyguard, Redis, wait_blocked, wait_until
from resp import Push, RespConn, encode

GET_SCRIPT = "return redis.call('GET', KEYS[1])"
CONFIG = open(os.path.join(ROOT, "examples", "tenants.yaml")).read().replace(
    "allowed_scripts: []", "allowed_scripts: [%s]" % hashlib.sha1(GET_SCRIPT.encode()).hexdigest())


@pytest.fixture(scope="module")
def server():
    r = Redis("--notify-keyspace-events", "KEA")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def kg(server):
    k = Keyguard(server.port, config=CONFIG)
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture
def direct(server):
    d = redis.Redis(port=server.port, decode_responses=True)
    d.flushall()
    return d


def as_user(kg, user, **kw):
    return redis.Redis(port=kg.port, username=user, password=user + "-secret", decode_responses=True, **kw)


def raw(kg, user=None, resp3=False):
    c = RespConn(kg.port)
    if resp3:
        reply = c.call("HELLO", "3", "AUTH", user, user + "-secret")
        assert isinstance(reply, dict) and reply[b"proto"] == 3
    elif user:
        assert c.call("AUTH", user, user + "-secret") == "OK"
    return c


def error(c, *args):
    v = c.call(*args)
    assert isinstance(v, Exception), (args, v)
    return str(v)


def test_shipped_example_alice_and_bob(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    assert alice.set("k", "v")
    assert direct.keys("*") == ["tenant:a:k"]
    assert bob.get("k") is None
    assert bob.keys("*") == []
    assert alice.get("k") == "v"
    # redis-cli (hiredis) with --user/--pass sees the same.
    cli = subprocess.run(["redis-cli", "-p", str(kg.port), "--user", "bob", "--pass", "bob-secret", "--no-auth-warning",
                          "SET", "k", "b"], capture_output=True, text=True, timeout=300)
    assert cli.stdout.strip() == "OK"
    assert sorted(direct.keys("*")) == ["tenant:a:k", "tenant:b:k"]
    assert alice.get("k") == "v" and bob.get("k") == "b"


def test_noauth_and_wrongpass_as_redis_answers(kg, direct):
    c = RespConn(kg.port)
    assert error(c, "GET", "k") == "NOAUTH Authentication required."
    assert error(c, "AUTH", "alice", "bob-secret") == "WRONGPASS invalid username-password pair or user is disabled."
    assert error(c, "AUTH", "mallory", "x") == "WRONGPASS invalid username-password pair or user is disabled."
    assert error(c, "AUTH", "alice-secret").startswith("WRONGPASS")  # one-argument AUTH is user "default"
    assert error(c, "HELLO", "3").startswith("NOAUTH HELLO must be called with the client already authenticated")
    assert error(c, "PING") == "NOAUTH Authentication required."
    assert error(c, "SET", "k", "v").startswith("NOAUTH")
    assert direct.keys("*") == []
    assert isinstance(c.call("HELLO", "3", "AUTH", "alice", "alice-secret"), dict)
    assert c.call("SET", "k", "v") == "OK"
    assert direct.keys("*") == ["tenant:a:k"]
    # RESET logs out.
    assert c.call("RESET") == "RESET"
    assert error(c, "GET", "k") == "NOAUTH Authentication required."
    assert c.call("AUTH", "bob", "bob-secret") == "OK"
    assert c.call("GET", "k") is None


@pytest.mark.not_cluster(reason='COPY s copied: tenant:a:s and tenant:a:copied are in different slots, CROSSSLOT as on a cluster node')
def test_reads_and_writes_never_reach_the_other_tenant(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    bob.set("s", "bob"), bob.hset("h", "f", "bob"), bob.rpush("l", "bob"), bob.sadd("set", "bob")
    bob.zadd("z", {"bob": 1}), bob.xadd("x", {"f": "bob"}, id="1-1")
    before = {k: direct.dump(k) for k in direct.keys("*")}
    # Alice names bob's keys every way she can think of.
    for name in ["s", "tenant:b:s", "../tenant:b:s", "*"]:
        assert alice.get(name) is None
    assert alice.hget("tenant:b:h", "f") is None and alice.lrange("tenant:b:l", 0, -1) == []
    assert alice.smembers("tenant:b:set") == set() and alice.zrange("tenant:b:z", 0, -1) == []
    assert alice.xrange("tenant:b:x") == []
    assert alice.exists("s", "h", "l", "set", "z", "x", "tenant:b:s") == 0
    alice.set("tenant:b:s", "alice"), alice.delete("s", "h"), alice.rename("s2", "s") if alice.exists("s2") else None
    alice.mset({"s": "alice", "h": "alice"})
    assert alice.copy("s", "copied")
    assert alice.object("encoding", "s") == "embstr"
    # Bob's data is byte-for-byte what it was; alice's writes landed under her prefix.
    assert {k: direct.dump(k) for k in direct.keys("tenant:b:*")} == before
    assert sorted(direct.keys("tenant:a:*")) == ["tenant:a:copied", "tenant:a:h", "tenant:a:s", "tenant:a:tenant:b:s"]
    assert bob.get("s") == "bob"


def test_enumeration_sees_only_own_keys(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    for i in range(30):
        bob.set("b%d" % i, i)
    alice.set("mine1", 1), alice.set("mine2", 2)
    direct.set("unprefixed", 1)
    assert sorted(alice.keys("*")) == ["mine1", "mine2"]
    assert alice.keys("tenant:b:*") == [] and alice.keys("b*") == []
    assert sorted(alice.scan_iter()) == ["mine1", "mine2"]
    assert sorted(alice.scan_iter(match="*", count=5)) == ["mine1", "mine2"]
    assert list(alice.scan_iter(match="tenant:*")) == []
    assert alice.dbsize() == 2
    assert bob.dbsize() == 30
    for _ in range(10):
        assert alice.randomkey() in ("mine1", "mine2")
    assert raw(kg, "alice").call("COMMAND", "GETKEYS", "MSET", "x", "1", "y", "2") == [b"x", b"y"]


def test_randomkey_of_an_empty_tenant_is_nil(kg, direct):
    as_user(kg, "bob").set("b", 1)
    assert as_user(kg, "alice").randomkey() is None
    assert as_user(kg, "alice").dbsize() == 0


def test_flush_only_touches_own_keys(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    for i in range(50):
        alice.set("a%d" % i, i)
        bob.set("b%d" % i, i)
    assert alice.flushdb() is True
    assert alice.keys("*") == [] and direct.keys("tenant:a:*") == []
    assert len(direct.keys("tenant:b:*")) == 50
    alice.set("again", 1)
    assert alice.flushall(asynchronous=True) is True
    assert direct.keys("tenant:a:*") == [] and bob.dbsize() == 50


@pytest.mark.not_cluster(reason='BLPOP empty q and LMPOP 2 nothing q2: keys in different slots, CROSSSLOT as on a cluster node')
def test_blocking_pops_return_unprefixed_keys(kg, direct):
    alice = as_user(kg, "alice")
    alice.rpush("q", "job")
    assert alice.blpop(["empty", "q"], timeout=1) == ("q", "job")
    alice.zadd("z", {"m": 1})
    assert alice.bzpopmin(["z"], timeout=1) == ("z", "m", 1.0)
    alice.rpush("q2", "a", "b")
    assert alice.execute_command("LMPOP", 2, "nothing", "q2", "LEFT") == ["q2", ["a"]]
    alice.zadd("z2", {"x": 1})
    assert alice.execute_command("ZMPOP", 1, "z2", "MIN") == ["z2", [["x", "1"]]]
    # A tenant's blocking pop is never woken by the other tenant's push to the same name.
    bob = as_user(kg, "bob")
    c = raw(kg, "alice")
    c.send("BRPOP", "shared", 0)
    wait_blocked(kg.upstream_port)
    bob.rpush("shared", "bobs")
    alice.rpush("shared", "alices")
    assert c.value() == [b"shared", b"alices"]
    assert direct.lrange("tenant:b:shared", 0, -1) == ["bobs"]


def test_streams_resp2_resp3_and_nogroup(kg, direct):
    alice = as_user(kg, "alice")
    alice.xadd("st", {"f": "v"}, id="1-1")
    assert alice.xread({"st": 0}) == [["st", [("1-1", {"f": "v"})]]]
    c = raw(kg, "alice", resp3=True)
    assert c.call("XREAD", "STREAMS", "st", "0") == {b"st": [[b"1-1", [b"f", b"v"]]]}
    err = error(c, "XREADGROUP", "GROUP", "g", "c", "STREAMS", "st", ">")
    assert err == "NOGROUP No such key 'st' or consumer group 'g' in XREADGROUP with GROUP option"
    alice.xgroup_create("st", "g", id="0")
    assert alice.xreadgroup("g", "c", {"st": ">"}) == [["st", [("1-1", {"f": "v"})]]]


@pytest.mark.not_cluster(reason='MULTI with SET k and BLPOP l: a transaction over keys of different slots is CROSSSLOT at EXEC, as on a cluster node')
def test_multi_exec_replies_are_rewritten_per_command(kg, direct):
    alice = as_user(kg, "alice")
    alice.rpush("l", "x")
    p = alice.pipeline(transaction=True)
    p.set("k", "v").keys("*").blpop(["l"], timeout=1).scan(0).get("k")
    res = p.execute()
    assert res[0] is True and sorted(res[1]) == ["k", "l"] and res[2] == ("l", "x")
    assert res[3][0] == 0 and sorted(res[3][1]) == ["k"] and res[4] == "v"


def test_pubsub_channels_are_separate(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    sub = raw(kg, "alice")
    sub.send("SUBSCRIBE", "news")
    assert sub.value() == [b"subscribe", b"news", 1]
    sub.send("PSUBSCRIBE", "*")
    assert sub.value() == [b"psubscribe", b"*", 2]
    assert bob.publish("news", "from bob") == 0
    assert direct.pubsub_channels() == ["tenant:a:news"]
    assert alice.publish("news", "from alice") == 2
    assert sub.value() == [b"message", b"news", b"from alice"]
    assert sub.value() == [b"pmessage", b"*", b"news", b"from alice"]
    assert alice.pubsub_channels() == ["news"] and bob.pubsub_channels() == []
    assert alice.pubsub_numsub("news") == [("news", 1)]
    assert "not allowed for tenants" in str(pytest.raises(redis.ResponseError, alice.pubsub_numpat).value)
    sub.send("PING")
    assert sub.value() == [b"pong", b""]


def test_keyspace_and_keyevent_notifications_are_confined(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    sub = raw(kg, "alice")
    sub.send("PSUBSCRIBE", "__keyspace@0__:*")
    assert sub.value() == [b"psubscribe", b"__keyspace@0__:*", 1]
    sub.send("SUBSCRIBE", "__keyevent@0__:set")
    assert sub.value() == [b"subscribe", b"__keyevent@0__:set", 2]
    bob.set("secret", 1)
    direct.set("unprefixed", 1)
    alice.set("mine", 1)
    assert sub.value() == [b"pmessage", b"__keyspace@0__:*", b"__keyspace@0__:mine", b"set"]
    assert sub.value() == [b"message", b"__keyevent@0__:set", b"mine"]
    # Nothing about bob's key or the unprefixed one arrives: the server sent their events first,
    # so a leak would have come before alice's own above; and nothing comes after them either.
    assert sub.quiet() == b""


def test_tracking_invalidations_are_confined(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    c = raw(kg, "alice", resp3=True)
    assert c.call("CLIENT", "TRACKING", "ON", "BCAST") == "OK"
    bob.set("k", 1)
    alice.set("k", 2)
    assert c.read() == (Push([b"invalidate", [b"k"]]), b">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n")


@pytest.mark.not_cluster(reason="CLIENT TRACKING REDIRECT is refused with a cluster, a tenant's too (client ids are per node)")
def test_tracking_redirect_invalidations_are_confined(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    # RESP2 redirect: the sink sees alice's key only.
    sink = raw(kg, "alice")
    sink_id = sink.call("CLIENT", "ID")
    sink.send("SUBSCRIBE", "__redis__:invalidate")
    assert sink.value() == [b"subscribe", b"__redis__:invalidate", 1]
    t = raw(kg, "alice")
    assert t.call("CLIENT", "TRACKING", "ON", "REDIRECT", sink_id) == "OK"
    assert t.call("GET", "t2") is None
    bob.set("t2", "x")
    alice.set("t2", "y")
    assert sink.value() == [b"message", b"__redis__:invalidate", [b"t2"]]


ESCAPES = [
    ("SWAPDB", "0", "1"), ("MOVE", "k", "1"), ("SELECT", "1"), ("COPY", "k", "c", "DB", "1"),
    ("MIGRATE", "127.0.0.1", "1", "k", "0", "100"), ("MONITOR",), ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"),
    ("CLIENT", "PAUSE", "100"), ("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "GET", "*"), ("DEBUG", "SLEEP", "0"),
    ("SLOWLOG", "GET"), ("ACL", "LIST"), ("ACL", "SETUSER", "x"), ("MODULE", "LIST"), ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"), ("FUNCTION", "LIST"),
    # (With a Redis Cluster upstream CLUSTER INFO, SLOTS, ... are keyguard's one-node view, served
    # to tenants: test_every_mode.py.) These count or name every tenant's keys, or change the cluster:
    ("CLUSTER", "COUNTKEYSINSLOT", "0"), ("CLUSTER", "GETKEYSINSLOT", "0", "10"), ("CLUSTER", "RESET"),
    ("SHUTDOWN",), ("REPLICAOF", "NO", "ONE"),
    ("EVAL", "return redis.call('KEYS', '*')", "0"), ("EVALSHA", "a" * 40, "0"), ("FCALL", "f", "0"),
    ("SCRIPT", "LOAD", "return 1"), ("BGSAVE",), ("SAVE",), ("LATENCY", "RESET"), ("FAILOVER",),
    # The replication stream hands out every tenant's data.
    ("SYNC",), ("PSYNC", "?", "-1"), ("REPLCONF", "rdb-only", "1"),
]


@pytest.mark.parametrize("args", ESCAPES, ids=[" ".join(a[:2]) for a in ESCAPES])
def test_escapes_are_refused_and_change_nothing(kg, direct, args):
    direct.set("tenant:b:k", "bob")
    direct.config_set("maxmemory", "0")
    c = raw(kg, "alice")
    assert c.call("SET", "k", "a") == "OK"
    err = error(c, *args)
    assert err.startswith("ERR keyguard:"), err
    assert c.call("PING") == "PONG"  # the connection stays usable
    assert sorted(direct.keys("*")) == ["tenant:a:k", "tenant:b:k"]
    assert direct.config_get("maxmemory") == {"maxmemory": "0"}
    assert direct.get("tenant:b:k") == "bob"


def test_allowed_script_runs_on_declared_keys_only(kg, direct):
    alice = as_user(kg, "alice")
    direct.set("tenant:b:k", "bob")
    alice.set("k", "alice")
    assert alice.eval(GET_SCRIPT, 1, "k") == "alice"
    sha = hashlib.sha1(GET_SCRIPT.encode()).hexdigest()
    assert alice.script_load(GET_SCRIPT) == sha
    assert alice.evalsha(sha, 1, "tenant:b:k") is None  # KEYS[1] is tenant:a:tenant:b:k


def test_info_hides_the_keyspace(kg, direct):
    alice = as_user(kg, "alice")
    direct.set("tenant:b:k", 1)
    c = raw(kg, "alice")
    info = c.call("INFO")
    assert b"# Server" in info and b"# Keyspace" not in info and b"db0:" not in info
    assert c.call("INFO", "keyspace") == b""
    # #12 side channels: what moves with other tenants' traffic is not shown.
    everything = c.call("INFO", "everything")
    for gone in (b"# Stats", b"# Commandstats", b"# Errorstats", b"# Latencystats", b"# Clients", b"# Memory",
                 b"# Persistence", b"# Replication", b"# CPU", b"keyspace_hits", b"blocked_clients"):
        assert gone not in everything, gone
    assert everything.startswith(b"# Server\r\n") and b"# Cluster\r\n" in everything
    for sub in ("DOCTOR", "MALLOC-STATS", "PURGE", "STATS"):
        assert str(c.call("MEMORY", sub)).startswith("ERR keyguard: command 'MEMORY %s' is not allowed" % sub)
    alice.set("mine", "v")
    assert c.call("MEMORY", "USAGE", "mine") > 0
    assert b"redis_version" in c.call("INFO", "server")
    assert "db0" not in alice.info() and "redis_version" in alice.info()


@pytest.mark.not_cluster(reason="SORT ... BY w_* GET o_*: 'BY option of SORT denied in Cluster mode' (Redis 7.0), as on a cluster node")
def test_sort_patterns_and_hash_tags(kg, direct):
    alice, bob = as_user(kg, "alice"), as_user(kg, "bob")
    alice.rpush("ids", 1, 2)
    alice.set("w_1", 20), alice.set("w_2", 10), alice.set("o_1", "one"), alice.set("o_2", "two")
    bob.set("w_1", 0), bob.set("o_1", "BOB")
    assert alice.sort("ids", by="w_*", get=["#", "o_*"]) == ["2", "two", "1", "one"]
    assert alice.sort("ids", by="w_*", store="sorted") == 2
    assert direct.lrange("tenant:a:sorted", 0, -1) == ["2", "1"]
    alice.set("{user1}:a", 1), alice.set("{user1}:b", 2)
    assert sorted(direct.keys("tenant:a:{user1}:*")) == ["tenant:a:{user1}:a", "tenant:a:{user1}:b"]
    # Both keep "user1" as their hash tag, so a cluster would still put them in one slot.
    assert alice.mget("{user1}:a", "{user1}:b") == ["1", "2"]


def plain_redis_program(r):
    """An app written for plain Redis, with nothing tenant-aware in it."""
    out = []
    r.flushdb()
    r.set("user:1:name", "ann", ex=100)
    r.hset("user:1", mapping={"name": "ann", "visits": 1})
    r.hincrby("user:1", "visits", 5)
    r.rpush("queue", "a", "b", "c")
    out.append(r.blpop(["queue"], timeout=1))
    r.zadd("board", {"ann": 10, "bob": 20})
    out.append(r.zrange("board", 0, -1, withscores=True))
    out.append(sorted(r.keys("user:*")))
    out.append(sorted(r.scan_iter("*")))
    out.append(r.dbsize())
    out.append(r.hgetall("user:1"))
    out.append(r.ttl("user:1:name") > 0)
    with r.pipeline() as p:
        p.watch("user:1:name")
        p.multi()
        p.get("user:1:name").lpop("queue").keys("q*")
        out.append(p.execute())
    out.append(r.exists("user:1", "nope"))
    out.append(r.type("board"))
    r.delete("board")
    out.append(r.randomkey() in ("user:1:name", "user:1", "queue"))
    return out


@pytest.mark.not_cluster(reason="the program's WATCH/MULTI over user:1:name and queue is CROSSSLOT even run directly on a cluster node")
def test_a_plain_redis_py_program_runs_unchanged(kg, direct):
    expected = plain_redis_program(direct)
    direct.flushall()
    direct.set("tenant:b:user:9", "bob")
    assert plain_redis_program(as_user(kg, "alice")) == expected
    assert direct.get("tenant:b:user:9") == "bob"


def test_metrics_per_tenant(server, direct):
    k = Keyguard(server.port, config=CONFIG)
    try:
        c = raw(k, "alice")
        for i in range(3):
            assert c.call("SET", "k%d" % i, "v") == "OK"
        assert error(c, "SWAPDB", "0", "1").startswith("ERR keyguard:")
        b = raw(k, "bob")
        assert b.call("GET", "k0") is None
        assert error(RespConn(k.port), "GET", "x").startswith("NOAUTH")
        assert k.metric('keyguard_tenant_commands_total{tenant="a"}') == 4
        assert k.metric('keyguard_tenant_commands_total{tenant="b"}') == 1
        set_bytes = len(b"*3\r\n$3\r\nSET\r\n$2\r\nk0\r\n$1\r\nv\r\n")
        swap_bytes = len(b"*3\r\n$6\r\nSWAPDB\r\n$1\r\n0\r\n$1\r\n1\r\n")
        assert k.metric('keyguard_tenant_received_bytes_total{tenant="a"}') == 3 * set_bytes + swap_bytes
        # Every reply the client got as the tenant: AUTH's own (keyguard's) and GET's.
        assert k.metric('keyguard_tenant_sent_bytes_total{tenant="b"}') == len(b"+OK\r\n$-1\r\n")
        assert k.metric('keyguard_tenant_rejected_total{tenant="a",reason="tenant"}') == 1
        assert k.metric('keyguard_commands_rejected_total{reason="noauth"}') == 1
    finally:
        assert k.stop() == 0, k.output()


@pytest.mark.not_cluster(reason="its second keyguard runs with --upstream-connections dedicated, which a cluster upstream refuses at start (always shared connections, documented)")
def test_static_tenant_and_upstream_credentials():
    r = Redis("--requirepass", "upstream-pw")
    try:
        pw = os.path.join(r.dir, "pw")
        with open(pw, "w") as f:
            f.write("upstream-pw\n")
        k = Keyguard(r.port, config='tenancy: {prefix: "svc:"}\nupstream_auth: {password_file: "%s"}\n' % pw)
        try:
            app = redis.Redis(port=k.port, decode_responses=True)  # no password: keyguard holds it
            assert app.set("k", "v") and app.get("k") == "v"
            assert app.keys("*") == ["k"]
            direct = redis.Redis(port=r.port, password="upstream-pw", decode_responses=True)
            assert direct.keys("*") == ["svc:k"]
            c = RespConn(k.port)
            assert error(c, "AUTH", "x").startswith("ERR AUTH <password> called without any password configured")
            assert c.call("RESET") == "RESET"
            assert c.call("GET", "k") == b"v"  # keyguard authenticated its connection again
        finally:
            assert k.stop() == 0, k.output()
        # A connection per client: with shared connections the client would stay connected (the
        # shared connection retries; test_shared_upstream.py covers that).
        bad = Keyguard(r.port, config='upstream_auth: {password: "wrong"}\n',
                       extra=("--upstream-connections", "dedicated"))
        try:
            # The fixture's readiness probe was a connection too, whose upstream AUTH may or may not
            # have failed before it closed: count from when it is gone.
            wait_until(lambda: bad.metric("keyguard_client_connections") == 0, "the readiness probe to close")
            before = bad.metric('keyguard_upstream_errors_total{reason="auth"}')
            # Whether keyguard's upstream AUTH fails before or after the PING arrives, the client
            # gets the error, then the connection closes.
            assert RespConn(bad.port).exchange(encode("PING"), closed=True) in (
                b"-ERR keyguard: upstream refused keyguard's AUTH: WRONGPASS invalid username-password pair or user "
                b"is disabled.\r\n<closed>",
                # Should the PING arrive first, it was already forwarded when the refusal came.
                b"-ERR keyguard: upstream unavailable\r\n<closed>")
            after = bad.metric('keyguard_upstream_errors_total{reason="auth"}')
            assert after == before + 1
            assert [e["error"] for e in bad.events("upstream_auth_failed")] == [
                "WRONGPASS invalid username-password pair or user is disabled."] * int(after)
        finally:
            bad.stop()
    finally:
        r.stop()


@pytest.mark.dedicated_only(reason="a shared connection keeps the secret it authenticated with; one whose AUTH is refused retries while its clients get the error and stay")
def test_a_rotated_upstream_password_is_used_by_new_connections_and_a_refused_one_is_told():
    r = Redis("--requirepass", "pw-1")
    pw = os.path.join(r.dir, "pw")

    def write_password(text):
        # As a Secret update: the new file renamed into place.
        with open(pw + ".new", "w") as f:
            f.write(text + "\n")
        os.rename(pw + ".new", pw)

    write_password("pw-1")
    k = Keyguard(r.port, config=CONFIG + 'upstream_auth: {password_file: "%s"}\n' % pw)
    try:
        direct = redis.Redis(port=r.port, password="pw-1", decode_responses=True)
        old = as_user(k, "alice")
        assert old.set("k", "1") is True
        # Redis takes the new password (open connections stay authenticated), then the file changes.
        assert direct.config_set("requirepass", "pw-2") is True
        write_password("pw-2")
        new = as_user(k, "alice")
        assert new.incr("n") == 1
        assert k.metric("keyguard_upstream_auth_reloads_total") == 1
        assert old.incr("k") == 2  # the old connection keeps going
        assert k.metric('keyguard_upstream_errors_total{reason="auth"}') == 0
        # A secret Redis refuses: counted, logged, and a client that logged in to keyguard is told.
        write_password("pw-stale")
        wait_until(lambda: k.metric("keyguard_client_connections") == 2, "only the two clients connected")
        c = RespConn(k.port)
        wait_until(lambda: k.metric('keyguard_upstream_errors_total{reason="auth"}') == 1, "the refused AUTH")
        assert c.call("AUTH", "alice", "alice-secret") == "OK"
        assert c.exchange(encode("GET", "k"), closed=True) == (
            b"-ERR keyguard: upstream refused keyguard's AUTH: WRONGPASS invalid username-password pair or user is "
            b"disabled.\r\n<closed>")
        assert k.metric("keyguard_upstream_auth_reloads_total") == 2
        assert [e["error"] for e in k.events("upstream_auth_failed")] == [
            "WRONGPASS invalid username-password pair or user is disabled."]
        stored = redis.Redis(port=r.port, password="pw-2")
        assert (stored.get("tenant:a:k"), stored.get("tenant:a:n")) == (b"2", b"1")
    finally:
        assert k.stop() == 0, k.output()
        r.stop()


def test_bad_tenancy_config_is_refused_with_the_field(server):
    import tempfile
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write('tenancy:\n  users:\n    - {name: a, password: x, prefix: "t:"}\n    - {name: b, password: y, prefix: "t:b:"}\n')
    out = subprocess.run([os.environ.get("KEYGUARD_BIN", os.path.join(ROOT, "build", "keyguard")), "check-config", path],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "prefix 't:' begins prefix 't:b:'" in out.stderr


def test_pipelined_rewrites_keep_every_value_byte_for_byte(kg, direct):
    """Prefixed commands go upstream as the client's bytes with only the keys re-encoded: a long
    pipeline of values of many sizes (one batch holds many rewritten commands) arrives intact."""
    import random
    rnd = random.Random(7)
    alice = redis.Redis(port=kg.port, username="alice", password="alice-secret")
    values = {"k%d" % i: bytes(rnd.getrandbits(8) for _ in range(rnd.choice([0, 1, 50, 3000, 70000])))
              for i in range(300)}
    p = alice.pipeline(transaction=False)
    for k, v in values.items():
        p.set(k, v)
    p.mset({"m1": b"\r\n$3\r\nfoo", "m2": b""})
    p.execute()
    raw_direct = redis.Redis(port=direct.connection_pool.connection_kwargs["port"])
    for k, v in values.items():
        assert raw_direct.get("tenant:a:" + k) == v
    assert raw_direct.get("tenant:a:m1") == b"\r\n$3\r\nfoo" and raw_direct.get("tenant:a:m2") == b""
    assert alice.mget("m1", "k0") == [b"\r\n$3\r\nfoo", values["k0"]]
