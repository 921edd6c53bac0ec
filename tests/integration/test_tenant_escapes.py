"""Escapes found in review of tenancy (issue #4): each test is a way tenant alice (tenant:a:) reached
or observed bob's (tenant:b:) keys before the fix. Same fixtures as test_tenants.py: one
redis-server with keyspace notifications, keyguard with examples/tenants.yaml."""
import os
import tempfile

import pytest

from conftest import CLUSTER_MODE, Keyguard, wait_blocked, wait_until
from resp import RespConn, encode
from test_tenants import CONFIG, GET_SCRIPT, as_user, direct, error, kg, raw, server  # noqa: F401 (fixtures)


def replies(c, data, n):
    """Sends raw bytes and returns the exact bytes of the `n` replies they get (and anything more
    that follows at once). A leak of another tenant's event that the server sent before these
    replies arrives before them, so it is in what this returns however slow the machine."""
    return c.exchange(data, replies=n)


def pipeline(*commands):
    return b"".join(encode(*a) for a in commands)


@pytest.mark.not_cluster(reason='GEORADIUS src ... STORE mine STORE tenant:b:x: source and destinations (tenant:a:...) in different slots, CROSSSLOT as on a cluster node, so nothing is stored')
def test_georadius_every_store_destination_gets_the_prefix(kg, direct):
    # GEORADIUS writes to the last STORE/STOREDIST; the key specs name only the first of each.
    direct.set("tenant:b:x", "bob")
    alice = as_user(kg, "alice")
    alice.geoadd("src", (13.36, 38.11, "p"))
    c = raw(kg, "alice")
    c.call("GEORADIUS", "src", "13.36", "38.11", "100", "km", "STORE", "mine", "STORE", "tenant:b:x")
    c.call("GEORADIUSBYMEMBER", "src", "p", "100", "km", "STOREDIST", "mine", "STOREDIST", "tenant:b:x")
    c.call("GEORADIUS", "src", "13.36", "38.11", "100", "km", "STORE", "mine", "STOREDIST", "tenant:b:y")
    assert direct.type("tenant:b:x") == "string" and direct.get("tenant:b:x") == "bob"
    assert sorted(direct.keys("*")) == ["tenant:a:src", "tenant:a:tenant:b:x", "tenant:a:tenant:b:y", "tenant:b:x"]


def test_subscribe_inside_multi_never_passes_messages_as_replies(kg, direct):
    # Confirmations inside EXEC are not tracked, so RESP2 messages arrived as the reply of the
    # next command, unfiltered.
    c = raw(kg, "alice")
    out = replies(c, pipeline(("MULTI",), ("SUBSCRIBE", "__keyevent@0__:set"), ("EXEC",)), 3)
    assert b"EXECABORT" in out
    as_user(kg, "bob").set("secret", 1)
    out += replies(c, pipeline(("PING",)), 1)
    assert b"tenant:b" not in out and b"secret" not in out, out


def test_a_long_publish_first_in_a_transaction_keeps_the_prefix(kg, direct):
    # With a cluster upstream, a keyless command sent alone as a transaction's first is held until
    # the transaction has its node; a rewrite of 1 KB or more is spliced into the client's bytes,
    # and the held copy was of the client's bytes: alice's PUBLISH reached bob's channel
    # (helper-42). Without a cluster, the same exchange checks the plain path.
    bob = raw(kg, "bob")
    bob.send("SUBSCRIBE", "news")
    assert bob.value() == [b"subscribe", b"news", 1]
    c = raw(kg, "alice")
    msg = "m" * 2000
    assert c.exchange(encode("MULTI"), replies=1) == b"+OK\r\n"
    assert c.exchange(encode("PUBLISH", "tenant:b:news", msg), replies=1) == b"+QUEUED\r\n"
    assert c.exchange(encode("EXEC"), replies=1) == b"*1\r\n:0\r\n"  # nobody on alice's tenant:b:news
    bob.send("PING")
    assert bob.value() == [b"pong", b""]  # (not alice's message)


@pytest.mark.parametrize("mode", ["OFF", "SKIP"])
def test_subscribe_without_replies_never_passes_messages_as_replies(kg, direct, mode):
    # Under CLIENT REPLY OFF/SKIP Redis still sends the confirmations; keyguard did not expect
    # them, so it never learnt the connection was subscribed.
    c = raw(kg, "alice")
    out = replies(c, pipeline(("CLIENT", "REPLY", mode), ("SUBSCRIBE", "__keyevent@0__:set"),
                              ("CLIENT", "REPLY", "ON")), 1)
    as_user(kg, "bob").set("secret", 1)
    out += replies(c, pipeline(("PING",)), 1)
    assert b"tenant:b" not in out and b"secret" not in out, out


def test_reset_after_client_reply_skip_keeps_replies_in_step(kg, direct):
    # Redis skips RESET's reply after CLIENT REPLY SKIP; keyguard waited for it, and every later
    # reply (subscribe confirmations among them) went to the command before.
    c = raw(kg, "alice")
    out = replies(c, pipeline(("CLIENT", "REPLY", "SKIP"), ("RESET",), ("AUTH", "alice", "alice-secret"),
                              ("SUBSCRIBE", "__keyevent@0__:set")), 2)
    assert out == b"+OK\r\n*3\r\n$9\r\nsubscribe\r\n$18\r\n__keyevent@0__:set\r\n:1\r\n", out
    as_user(kg, "bob").set("secret", 1)
    as_user(kg, "alice").set("mine", 1)
    out = replies(c, pipeline(("PING",)), 2)
    assert out == (b"*3\r\n$7\r\nmessage\r\n$18\r\n__keyevent@0__:set\r\n$4\r\nmine\r\n"
                   b"*2\r\n$4\r\npong\r\n$0\r\n\r\n"), out


def test_hello_without_replies_cannot_hide_the_protocol(kg, direct):
    # HELLO under CLIENT REPLY OFF switched the server to RESP2 while keyguard kept RESP3, so
    # RESP2 messages were not recognised as messages.
    c = raw(kg, "alice", resp3=True)
    out = replies(c, pipeline(("CLIENT", "REPLY", "OFF"), ("HELLO", "2"), ("CLIENT", "REPLY", "ON"),
                              ("SUBSCRIBE", "__keyevent@0__:set")), 2)
    as_user(kg, "bob").set("secret", 1)
    out += replies(c, pipeline(("PING",)), 1)
    assert b"tenant:b" not in out and b"secret" not in out, out


def test_reset_keeps_filtering_until_the_server_has_reset(kg, direct):
    # RESET logged the client out at once, and what the server still sent before its +RESET
    # (here: notifications during a blocking pop) passed without the tenant filter.
    c = raw(kg, "alice", resp3=True)
    c.send("SUBSCRIBE", "__keyevent@0__:set")
    c.value()
    c.send_raw(pipeline(("BLPOP", "l", "1"), ("RESET",)))
    wait_blocked(kg.upstream_port)  # BLPOP blocks in the server, RESET waits behind it
    as_user(kg, "bob").set("secret", 1)
    out = replies(c, b"", 2)  # BLPOP's timeout, then RESET's reply
    assert b"+RESET" in out
    assert b"tenant:b" not in out and b"secret" not in out, out


def test_nested_multi_keeps_the_rewrite_of_each_queued_command(kg, direct):
    # Redis answers a nested MULTI with an error and keeps the transaction; keyguard forgot the
    # rewrites queued before it, so INFO inside EXEC kept its # Keyspace section.
    direct.set("tenant:b:k", 1)
    c = raw(kg, "alice")
    assert c.call("MULTI") == "OK"
    assert c.call("INFO") == "QUEUED"
    assert "nested" in str(c.call("MULTI"))
    assert c.call("PING") == "QUEUED"
    info, pong = c.call("EXEC")
    assert b"# Server" in info and b"db0:" not in info and b"# Keyspace" not in info
    assert pong == "PONG"


@pytest.mark.not_cluster(reason="SORT ... GET #: 'GET option of SORT denied in Cluster mode' (Redis 7.0), as on a cluster node")
def test_sort_patterns_with_a_glob_prefix_stay_inside(server, direct):
    # SORT substitutes the element at the pattern's first '*': with a '*' in the prefix, the
    # element chose the key ("t" + "enant:b" + ":x").
    k = Keyguard(server.port, config='tenancy: {prefix: "t*:"}\n')
    try:
        direct.set("tenant:b:x", "BOBSECRET")
        c = RespConn(k.port)
        assert c.call("RPUSH", "ids", "enant:b") == 1
        got = c.call("SORT", "ids", "BY", "nosort", "GET", "x")
        assert "BOBSECRET" not in str(got)
        assert "not allowed" in str(c.call("SORT", "ids", "BY", "w"))
        assert "not allowed" in str(c.call("SORT_RO", "ids", "GET", "x"))
        assert c.call("SORT", "ids", "ALPHA", "GET", "#") == [b"enant:b"]
    finally:
        assert k.stop() == 0, k.output()


def test_memory_stats_does_not_count_every_tenants_keys(kg, direct):
    # keys.count and db.0 are the key counts INFO's # Keyspace section is removed for.
    direct.set("tenant:b:k", 1)
    c = raw(kg, "alice")
    assert "not allowed for tenants" in str(c.call("MEMORY", "STATS"))
    assert c.call("SET", "k", "v") == "OK" and isinstance(c.call("MEMORY", "USAGE", "k"), int)


@pytest.mark.not_cluster(reason='SORT alist ... STORE tenant:b:secret: source and destination in different slots, CROSSSLOT as on a cluster node')
@pytest.mark.parametrize("word", ["GET", "by", "Get"])
def test_sort_stores_only_where_the_server_stores_inside_the_prefix(kg, direct, word):
    # #12 break 1: the key finder followed Redis's sortGetKeys, which does not skip STORE's
    # argument, while SORT stores into the last STORE: bob's string became alice's sorted list,
    # and an empty source deleted bob's hash.
    direct.set("tenant:b:secret", "bob")
    direct.hset("tenant:b:bhash", "f", "v")
    c = raw(kg, "alice")
    assert c.call("RPUSH", "alist", "3", "1", "2") == 3
    assert c.call("SORT", "alist", "STORE", word, "STORE", "tenant:b:secret") == 3
    assert c.call("SORT", "emptylist", "STORE", word, "STORE", "tenant:b:bhash") == 0
    out = c.exchange(b"SORT alist store %s STORE tenant:b:secret\r\n" % word.encode(), replies=1)  # inline
    assert out == b":3\r\n"
    assert direct.get("tenant:b:secret") == "bob" and direct.hgetall("tenant:b:bhash") == {"f": "v"}
    assert direct.lrange("tenant:a:tenant:b:secret", 0, -1) == ["1", "2", "3"]
    assert sorted(direct.keys("*")) == ["tenant:a:alist", "tenant:a:tenant:b:secret", "tenant:b:bhash",
                                        "tenant:b:secret"]


@pytest.mark.not_cluster(reason="with a STORE into another slot the node answers CROSSSLOT first, keyguard's tenant "
                        "check its syntax error first; nothing is written either way")
def test_sort_options_the_server_refuses_are_refused_with_its_error(kg, direct):
    c = raw(kg, "alice")
    c.call("RPUSH", "alist", "1")
    d = RespConn(direct.connection_pool.connection_kwargs["port"])
    for args in (("SORT", "alist", "NOSUCH", "STORE", "x"), ("SORT", "alist", "LIMIT", "0", "STORE", "STORE", "x"),
                 ("SORT_RO", "alist", "STORE", "x")):
        mine, servers = c.call(*args), d.call(*args)
        assert isinstance(mine, Exception) and str(mine) == str(servers), (args, mine, servers)
    assert c.call("PING") == "PONG"
    assert sorted(direct.keys("*")) == ["tenant:a:alist"]


def test_unwatch_inside_multi_keeps_each_exec_reply_filtered(kg, direct):
    # #12 break 2: UNWATCH inside MULTI is queued by Redis but was not recorded, so the EXEC
    # reply filters were shifted by one and INFO's keyspace came back unfiltered.
    direct.set("tenant:b:k", 1)
    bob = as_user(kg, "bob")
    bob_sub = bob.pubsub()
    bob_sub.subscribe("bobs-channel")
    c = raw(kg, "alice")
    out = c.exchange(pipeline(("MULTI",), ("UNWATCH",), ("INFO", "keyspace"), ("PUBSUB", "CHANNELS", "*"), ("EXEC",)),
                     replies=5)
    assert out == b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n*3\r\n+OK\r\n$0\r\n\r\n*0\r\n", out
    bob_sub.close()


def test_multi_the_server_refuses_starts_no_transaction(kg, direct):
    # #12 break 3: 'MULTI x' (an arity error: no transaction) switched reply filtering off until
    # EXEC/DISCARD; INFO showed the whole server's keyspace and alice's keys came back prefixed.
    direct.set("tenant:b:k", 1)
    c = raw(kg, "alice")
    out = c.exchange(pipeline(("MULTI", "x"), ("SET", "k", "v"), ("INFO", "keyspace"), ("KEYS", "*"), ("EXEC", "x"),
                              ("EXEC",)), replies=6)
    abort = b"-EXECABORT Transaction discarded because of: wrong number of arguments for 'exec' command\r\n"
    assert out == (b"-ERR wrong number of arguments for 'multi' command\r\n+OK\r\n$0\r\n\r\n*1\r\n$1\r\nk\r\n" +
                   abort + b"-ERR EXEC without MULTI\r\n"), out
    # Inside a transaction a refused 'EXEC x' discards it (execCommandAbort): what follows runs.
    out = c.exchange(pipeline(("MULTI",), ("EXEC", "x"), ("INFO", "keyspace"), ("EXEC",), ("DISCARD", "x")),
                     replies=5)
    assert out == (b"+OK\r\n" + abort + b"$0\r\n\r\n-ERR EXEC without MULTI\r\n"
                   b"-ERR wrong number of arguments for 'discard' command\r\n"), out
    # 'DISCARD x' inside a transaction ends nothing: the server keeps queueing, and EXEC aborts.
    out = c.exchange(pipeline(("MULTI",), ("DISCARD", "x"), ("INFO", "keyspace"), ("EXEC",), ("INFO", "keyspace")),
                     replies=5)
    assert out == (b"+OK\r\n-ERR wrong number of arguments for 'discard' command\r\n+QUEUED\r\n"
                   b"-EXECABORT Transaction discarded because of previous errors.\r\n$0\r\n\r\n"), out


def test_a_transaction_state_keyguard_did_not_foresee_closes_the_connection(server, direct):
    # Whatever makes the server refuse a MULTI keyguard took as started (here: keyguard's own
    # upstream user may not run MULTI), no reply may then pass with the wrong filter: the
    # connection is closed with an error and nothing the server sent for it is delivered.
    direct.execute_command("ACL", "SETUSER", "kg-nomulti", "on", ">pw", "~*", "&*", "+@all", "-multi")
    fd, pw = tempfile.mkstemp()
    with os.fdopen(fd, "w") as f:
        f.write("pw\n")
    k = Keyguard(server.port, config=CONFIG + 'upstream_auth: {user: kg-nomulti, password_file: "%s"}\n' % pw)
    try:
        direct.set("tenant:b:k", 1)
        c = raw(k, "alice")
        out = c.exchange(pipeline(("MULTI",), ("INFO", "keyspace"), ("EXEC",)), closed=True)
        if CLUSTER_MODE:
            # keyguard answered the MULTI and sent it before the transaction's first command, which
            # waited for its +OK: nothing else was sent, and the client is told why it ends.
            assert out == (b"+OK\r\n-ERR keyguard: the upstream refused the transaction's MULTI (NOPERM this user "
                           b"has no permissions to run the 'multi' command); the connection is closed\r\n<closed>"), out
            assert '"event":"upstream_multi_failed"' in k.output()
            # A refusal, not a protocol error (the server spoke RESP all along).
            assert k.metric('keyguard_upstream_errors_total{reason="refused"}') == 1
            assert k.metric('keyguard_upstream_errors_total{reason="protocol"}') == 0
            return
        desync = b"-ERR keyguard: the server's transaction state differs from keyguard's; the connection is closed\r\n"
        assert out == desync * 3 + b"<closed>", out
        assert k.metric("keyguard_unexpected_replies_total") == 1
        assert '"event":"transaction_state_differs","command":"multi"' in k.output()
    finally:
        assert k.stop() == 0, k.output()
        direct.execute_command("ACL", "DELUSER", "kg-nomulti")
        os.unlink(pw)


@pytest.mark.parametrize("pattern", ["__keyspace@[^__:]*", "__keyspace@*__:*"])
def test_keyspace_patterns_not_provably_confined_are_refused(kg, direct, pattern):
    # #12 break 4: the prefix went in after the first "__:", inside the class of
    # `__keyspace@[^__:]*`, which then matched every tenant's keyspace channels.
    bob = as_user(kg, "bob").pubsub()
    bob.subscribe("__keyspace@0__:bobs")  # a channel of bob's that such a pattern would list
    c = raw(kg, "alice")
    for args in (("PSUBSCRIBE", pattern), ("PUBSUB", "CHANNELS", pattern)):
        err = c.call(*args)
        assert isinstance(err, Exception) and str(err).startswith(
            "ERR keyguard: this pattern may match other tenants' channels"), (args, err)
    assert c.call("PUBSUB", "CHANNELS", "__keyspace@0__:*") == []  # alice's own: none
    assert c.call("PING") == "PONG"
    bob.close()


def test_detectors_keep_each_tenants_state_apart(server, direct):
    # #12 break 5: detector state was keyed by the client's names, so with a reject rule bob's
    # write was refused for alice's keys, and the refusal named them.
    config = CONFIG + "hygiene:\n  expiry_cluster_keys: 4\n  rules:\n    hash_candidate: {action: reject}\n" \
                      "    expiry_clustering: {action: reject}\n"
    k = Keyguard(server.port, config=config, threads=1)  # one worker: one set of detector state
    try:
        alice, bob = raw(k, "alice"), raw(k, "bob")
        assert alice.call("SET", "user:1:name", "ann") == "OK"
        assert alice.call("SET", "user:1:email", "a@x") == "OK"
        assert bob.call("SET", "user:1:phone", "1") == "OK"  # bob's first attribute, not alice's third
        refused = alice.call("SET", "user:1:phone", "2")
        assert isinstance(refused, Exception) and str(refused) == (
            "ERR keyguard: hash_candidate: one attribute per key: keep them in one Hash, HSET user:1 name ... email ... "
            "phone ..."), refused
        at = int(direct.time()[0]) + 3600
        for i in range(3):  # three keys each in one expiry second: under the threshold for either
            assert alice.call("SET", "tok:%d" % i, "v", "EXAT", at) == "OK"
            assert bob.call("SET", "tok:%d" % i, "v", "EXAT", at) == "OK"
        refused = bob.call("SET", "tok:3", "v", "EXAT", at)  # bob's fourth
        assert isinstance(refused, Exception) and "expiry_clustering" in str(refused), refused
        assert direct.get("tenant:b:user:1:phone") == "1" and direct.get("tenant:a:user:1:phone") is None
        findings = __import__("json").loads(k.http("/debug/findings")[1])["findings"]
        assert sorted((f["kind"], f["tenant"]) for f in findings) == [("expiry_clustering", "b"),
                                                                      ("hash_candidate", "a")], findings
    finally:
        assert k.stop() == 0, k.output()


@pytest.mark.not_cluster(reason='GEORADIUS nosrc ... STORE\\0 tenant:b:secret: source and destination in different slots, CROSSSLOT as on a cluster node')
def test_a_nul_in_an_option_word_hides_nothing(kg, direct):
    # Review of this session's changes: Redis reads option words with strcasecmp on C strings, so
    # "STORE\0" is STORE to the server; keyguard compared whole arguments and missed it.
    direct.set("tenant:b:secret", "bob")
    c = raw(kg, "alice")
    # GEORADIUS with an empty source deletes its STORE destination: bob's key, unprefixed, before.
    assert c.call("GEORADIUS", "nosrc", "0", "0", "1", "km", b"STORE\x00", "tenant:b:secret") == 0
    assert c.call("GEOADD", "src", "13.36", "38.11", "palermo") == 1
    assert c.call("GEORADIUSBYMEMBER", "src", "palermo", "100", "km", b"storedist\x00x", "tenant:b:z") == 1
    assert direct.get("tenant:b:secret") == "bob" and direct.exists("tenant:b:z") == 0
    assert direct.type("tenant:a:tenant:b:z") == "zset"
    # CLIENT REPLY skip\0 skips the next reply in the server: keyguard must know it, or every later
    # reply would be filtered by an earlier command's rules (INFO keyspace leaked).
    out = c.exchange(encode("CLIENT", "REPLY", b"skip\x00") + encode("PING") + encode("INFO", "keyspace") +
                     encode("KEYS", "*"), replies=2)
    assert out.startswith(b"$0\r\n\r\n*") and b"db0" not in out and b"tenant:a:" not in out, out
    # COPY ... DB\0 1 is COPY ... DB 1 to the server: refused like it.
    assert str(c.call("COPY", "src", "dst", b"DB\x00", "1")) == "ERR keyguard: COPY ... DB is not allowed for tenants"
    assert c.call("PING") == "PONG"


# #12 side channels: a key count that does not fit the arguments. keyguard answered "wrong number
# of arguments" for every one; the server's own texts differ by command and by which check fails.
BAD_NUMKEYS = [
    ("SINTERCARD", "0", "k"), ("SINTERCARD", "x", "k"), ("SINTERCARD", "2", "k"), ("SINTERCARD", "-1", "k"),
    ("ZUNIONSTORE", "d", "3", "a", "x"), ("ZUNIONSTORE", "d", "0", "a"), ("ZUNIONSTORE", "d", "x", "a"),
    ("ZINTERSTORE", "d", "-1", "a"), ("ZDIFFSTORE", "d", "2", "a"), ("ZINTER", "0", "a"), ("ZUNION", "2", "a"),
    ("ZDIFF", "9", "a"), ("ZINTERCARD", "0", "a"), ("ZINTERCARD", "2", "a"), ("LMPOP", "0", "LEFT"),
    ("LMPOP", "x", "a", "LEFT"), ("LMPOP", "3", "a", "LEFT"), ("BLMPOP", "0", "0", "a", "LEFT"),
    ("BLMPOP", "x", "9", "a", "LEFT"), ("ZMPOP", "-1", "a", "MIN"), ("BZMPOP", "0", "5", "a", "MIN"),
    ("EVAL", GET_SCRIPT, "-1"), ("EVAL", GET_SCRIPT, "2", "a"),
]


@pytest.mark.parametrize("args", BAD_NUMKEYS, ids=[" ".join(a[:1] + a[2:]) for a in BAD_NUMKEYS])
def test_bad_key_counts_get_the_servers_own_error(kg, direct, server, args):
    direct.zadd("tenant:b:a", {"m": 1})
    direct.rpush("tenant:b:x", "v")
    before = sorted(direct.keys("*"))
    plain = RespConn(server.port)
    c = raw(kg, "alice")
    try:
        expected = plain.exchange(encode(*args), replies=1)
        assert expected.startswith(b"-ERR ") and b"keyguard" not in expected, expected
        assert c.exchange(encode(*args), replies=1) == expected
        # In a transaction the server queues the command and fails it at EXEC (or, for a wrong
        # arity, refuses it and aborts EXEC), as it does directly.
        block = encode("MULTI") + encode(*args) + encode("EXEC")
        expected = plain.exchange(block, replies=3)
        assert expected.startswith(b"+OK\r\n+QUEUED\r\n*1\r\n-ERR ") or b"-EXECABORT" in expected, expected
        assert c.exchange(block, replies=3) == expected
    finally:
        plain.close()
    assert sorted(direct.keys("*")) == before
    assert direct.zrange("tenant:b:a", 0, -1) == ["m"] and direct.lrange("tenant:b:x", 0, -1) == ["v"]


REDIRECT_REFUSED = "ERR keyguard: CLIENT TRACKING REDIRECT may only name a connection of the same tenant"


def tracking_of(direct, client_id):
    """(flags, redir) of the server's connection `client_id`, read on a direct connection."""
    for c in direct.client_list():
        if int(c["id"]) == client_id:
            return c["flags"], int(c["redir"])
    return None


@pytest.mark.not_cluster(reason="CLIENT TRACKING REDIRECT is refused with a cluster, a tenant's too (client ids are per node)")
def test_tracking_redirect_names_only_the_tenants_own_connections(kg, direct, server):
    # #12 side channels: CLIENT TRACKING REDIRECT took any client id, so alice could send the
    # invalidations of her reads to bob's connection, or learn which ids exist from the error.
    bob = raw(kg, "bob")
    bob_id = bob.call("CLIENT", "ID")
    plain = RespConn(server.port)
    plain_id = plain.call("CLIENT", "ID")
    sink = raw(kg, "alice")
    sink_id = sink.call("CLIENT", "ID")
    c = raw(kg, "alice")
    c_id = c.call("CLIENT", "ID")
    for target in (bob_id, plain_id, 987654321, -1):
        for args in (("ON", "REDIRECT", target), ("ON", "BCAST", "REDIRECT", target), ("OFF", "REDIRECT", target),
                     ("ON", "REDIRECT", sink_id, "REDIRECT", target)):
            assert error(c, "CLIENT", "TRACKING", *args) == REDIRECT_REFUSED, (args, target)
    assert tracking_of(direct, c_id) == ("N", -1)  # the server saw none of them
    # Not a number: the server's own error.
    assert error(c, "CLIENT", "TRACKING", "ON", "REDIRECT", "x") == "ERR value is not an integer or out of range"
    # The tenant's own connection: as Redis does it.
    assert c.call("CLIENT", "TRACKING", "ON", "REDIRECT", sink_id) == "OK"
    assert tracking_of(direct, c_id) == ("t", sink_id)
    assert c.call("CLIENT", "TRACKING", "OFF") == "OK"
    # A connection that logs out and in as bob is bob's from then on.
    assert sink.call("RESET") == "RESET" and sink.call("AUTH", "bob", "bob-secret") == "OK"
    assert error(c, "CLIENT", "TRACKING", "ON", "REDIRECT", sink_id) == REDIRECT_REFUSED
    assert bob.call("CLIENT", "TRACKING", "ON", "REDIRECT", sink_id) == "OK"
    assert tracking_of(direct, bob_id) == ("t", sink_id)
    # A closed connection's id is forgotten with it (keyguard unregisters before it closes upstream).
    mine = raw(kg, "alice")
    mine_id = mine.call("CLIENT", "ID")
    assert c.call("CLIENT", "TRACKING", "ON", "REDIRECT", mine_id) == "OK"
    assert c.call("CLIENT", "TRACKING", "OFF") == "OK"
    mine.close()
    wait_until(lambda: tracking_of(direct, mine_id) is None, "the closed connection to leave the server")
    assert error(c, "CLIENT", "TRACKING", "ON", "REDIRECT", mine_id) == REDIRECT_REFUSED
    assert tracking_of(direct, c_id) == ("N", -1)
    plain.close()


@pytest.mark.parametrize("args", [("CLIENT", "KILL", "ID", "1"), ("CLIENT", "KILL", "127.0.0.1:1"),
                                  ("CLIENT", "KILL", "SKIPME", "no", "ID", "1"), ("CLIENT", "UNBLOCK", "1"),
                                  ("CLIENT", "UNBLOCK", "1", "ERROR"), ("CLIENT", "LIST", "ID", "1")])
def test_other_commands_taking_a_client_id_are_refused(kg, direct, args):
    c = raw(kg, "alice")
    assert error(c, *args) == "ERR keyguard: command '%s %s' is not allowed for tenants" % args[:2]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_trackinginfo_shows_the_clients_own_prefixes(kg, direct, server, resp3):
    # #12 side channels: CLIENT TRACKINGINFO showed the prefixes as the server holds them, with
    # the tenant's prefix. Through keyguard it must read as it does on a connection of its own.
    plain = RespConn(server.port)
    c = raw(kg, "alice", resp3=resp3)
    if resp3:
        plain.call("HELLO", "3")
    try:
        for tracking in (("ON", "BCAST", "PREFIX", "user:", "PREFIX", "x"), ("ON", "BCAST"), ("ON",)):
            block = (encode("CLIENT", "TRACKING", *tracking) + encode("CLIENT", "TRACKINGINFO") +
                     encode("MULTI") + encode("CLIENT", "TRACKINGINFO") + encode("EXEC") +
                     encode("CLIENT", "TRACKING", "OFF"))
            expected = plain.exchange(block, replies=6)
            assert c.exchange(block, replies=6) == expected, tracking
            assert b"tenant:" not in expected
        # The server holds the tenant's prefixes: its own write is announced, bob's is not.
        c_id = c.call("CLIENT", "ID")
        assert c.call("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "user:") == "OK"
        assert [x["flags"] for x in direct.client_list() if int(x["id"]) == c_id] == ["tB"]
        direct.set("tenant:b:user:1", "bob")
        direct.set("tenant:a:user:1", "alice")
        if resp3:
            assert c.read()[1] == b">2\r\n$10\r\ninvalidate\r\n*1\r\n$6\r\nuser:1\r\n"
        assert c.call("CLIENT", "TRACKINGINFO") == (
            {b"flags": ("set", [b"on", b"bcast"]), b"redirect": 0, b"prefixes": [b"user:"]} if resp3 else
            [b"flags", [b"on", b"bcast"], b"redirect", 0, b"prefixes", [b"user:"]])
    finally:
        plain.close()


def monitored_eval_scripts(mon, n):
    """The script bodies of the next `n` EVALs a MONITOR connection reports (sdscatrepr-quoted)."""
    import codecs
    import re
    scripts = []
    while len(scripts) < n:
        line = mon.value()
        words = [codecs.escape_decode(w)[0] for w in re.findall(rb'"((?:[^"\\]|\\.)*)"', line.encode())]
        if words and words[0].upper() == b"EVAL":
            scripts.append(words[1])
    return scripts


def test_script_exists_does_not_tell_what_others_ran(kg, direct, server):
    # #12 side channels: keyguard emulates DBSIZE, RANDOMKEY and FLUSHDB with EVAL, which puts its
    # scripts in the server's cache: SCRIPT EXISTS of their SHA1s told alice whether bob had used
    # them since the last SCRIPT FLUSH (and of any SHA1 whether any client had run that script).
    import hashlib
    direct.script_flush()
    mon = RespConn(server.port)
    assert mon.call("MONITOR") == "OK"
    bob = raw(kg, "bob")
    assert bob.call("SET", "k", "v") == "OK"
    assert bob.call("DBSIZE") == 1 and bob.call("RANDOMKEY") == b"k" and bob.call("FLUSHDB") == "OK"
    own = [hashlib.sha1(s).hexdigest() for s in monitored_eval_scripts(mon, 3)]
    mon.close()
    other = direct.script_load("return 'not a tenant script'")
    allowed = hashlib.sha1(GET_SCRIPT.encode()).hexdigest()
    assert direct.script_exists(*own, other, allowed) == [True, True, True, True, False]  # the server knows them
    c = raw(kg, "alice")
    shas = own + [s.upper() for s in own] + [other, allowed, allowed.upper()]
    assert c.call("SCRIPT", "EXISTS", *shas) == [0] * 9
    assert c.call("SCRIPT", "LOAD", GET_SCRIPT) == allowed.encode()
    assert c.call("SCRIPT", "EXISTS", *shas) == [0] * 7 + [1, 1]  # an allowed script: as the server says
    out = c.exchange(encode("MULTI") + encode("SCRIPT", "EXISTS", own[0], allowed) + encode("EXEC"), replies=3)
    assert out == b"+OK\r\n+QUEUED\r\n*1\r\n*2\r\n:0\r\n:1\r\n"
    assert direct.script_exists(*own) == [True, True, True]  # nothing was flushed
def test_client_reply_on_a_subscribed_connection_keeps_replies_in_step(kg, direct):
    # Found by test_tenant_fuzz: a RESP2 server refuses CLIENT REPLY while subscribed, but keyguard
    # followed the SKIP, so the server's replies ran two ahead of keyguard's: INFO's keyspace
    # (every tenant's key count) arrived as a PING's reply, unfiltered, and later replies were lost.
    direct.set("tenant:b:k", 1)
    c = raw(kg, "alice")
    out = c.exchange(pipeline(("SUBSCRIBE", "ch"), ("CLIENT", "REPLY", "SKIP"), ("PING",), ("UNSUBSCRIBE",),
                              ("INFO", "keyspace"), ("PING", "x")), replies=6)
    assert out == (b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n"
                   b"-ERR keyguard: CLIENT REPLY on a subscribed connection is not allowed for tenants\r\n"
                   b"*2\r\n$4\r\npong\r\n$0\r\n\r\n*3\r\n$11\r\nunsubscribe\r\n$2\r\nch\r\n:0\r\n"
                   b"$0\r\n\r\n$1\r\nx\r\n"), out


@pytest.mark.parametrize("command", [("CLIENT", "REPLY\x00x", "SKIP"), ("CLIENT\x00", "REPLY", "OFF"), ("MULTI\x00",),
                                     ("SET\x00x", "k", "v"), ("XINFO", "GROUPS\x00STORE", "s")])
def test_names_holding_a_nul_are_refused(kg, direct, command):
    # Found by test_tenant_fuzz: the server finds "REPLY\0x" only when its hash shares a bucket with
    # "reply" (a dict hashed on every byte, compared with strcasecmp), so whether CLIENT REPLY SKIP
    # ran depended on the server's random hash seed, and keyguard's reply matching with it.
    c = raw(kg, "alice")
    out = c.exchange(pipeline(command, ("INFO", "keyspace"), ("PING", "x")), replies=3)
    assert out == (b"-ERR keyguard: a command or subcommand name holding a NUL byte is not allowed for tenants\r\n"
                   b"$0\r\n\r\n$1\r\nx\r\n"), out
    assert direct.keys("*") == []


@pytest.mark.parametrize("command", ["SORT", "SORT_RO"])
def test_bare_sort_gets_the_servers_arity_error(kg, direct, command):
    # Found by test_tenant_fuzz (seed 2): the key finder named argument 1 of a bare SORT_RO, and
    # the tenant stage wrote the prefixed key past the end of the argument list (heap corruption:
    # keyguard crashed with "malloc(): corrupted top size" or hung).
    c = raw(kg, "alice")
    out = c.exchange(pipeline((command,), ("PING", "x")), replies=2)
    assert out == b"-ERR wrong number of arguments for '%s' command\r\n$1\r\nx\r\n" % command.lower().encode(), out
