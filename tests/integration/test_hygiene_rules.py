"""Hygiene rules with actions, TTL hygiene and the sizing probe, through keyguard against a real
redis-server: each finding triggered and checked in /debug/findings, /metrics and the JSON log,
each with a negative case; rewrites and rejections checked on the server itself."""
import json
import os
import tempfile
import time

import pytest
import redis

from conftest import Keyguard, wait_until
from resp import RespConn


def findings(kg, kind=None):
    status, body = kg.http("/debug/findings")
    assert status == 200
    fs = json.loads(body)["findings"]
    return [f for f in fs if kind is None or f["kind"] == kind]


def wait_for(pred):
    return wait_until(pred, "the finding")


def server_time(direct):
    """The server's clock in seconds, to the millisecond."""
    s, us = direct.time()
    return s + us // 1000 / 1000


def expire_times(direct, keys):
    """The keys' absolute expiry in seconds (PEXPIRETIME, to the millisecond): unlike TTL it does
    not shrink while a slow test runs, so a bound on it holds however long the test takes."""
    return [direct.execute_command("PEXPIRETIME", k) / 1000 for k in keys]


def counted_and_logged(kg, kind, key_pattern, n=1):
    """The finding is in /metrics exactly `n` times for the pattern, and in the JSON log."""
    assert kg.metric('keyguard_findings_total{kind="%s",key_pattern="%s"}' % (kind, key_pattern)) == n
    lines = kg.events("finding")
    assert any(l["kind"] == kind and l["key_pattern"] == key_pattern for l in lines), lines


def commandstat(direct, name):
    return direct.info("commandstats").get("cmdstat_" + name, {}).get("calls", 0)


@pytest.fixture
def direct(fresh):
    d = redis.Redis(port=fresh.port, decode_responses=True)
    d.config_resetstat()
    return d


def start(fresh, config="", threads=1):
    return Keyguard(fresh.port, config=config or None, threads=threads)


def test_del_of_a_big_key_is_found_and_rewritten_to_unlink(fresh, direct):
    kg = start(fresh, "hygiene:\n  rules:\n    del_big_key: {action: rewrite}\n")
    try:
        r = redis.Redis(port=kg.port)
        r.set("blob:1", "x" * 20000)
        r.set("small:1", "x")
        assert r.delete("small:1") == 1
        assert findings(kg, "del_big_key") == []  # a small key: nothing
        assert r.delete("blob:1") == 1
        [f] = findings(kg, "del_big_key")
        assert f["key"] == "blob:1" and f["bytes"] == 20000 and f["action"] == "rewrite"
        assert f["suggestion"].startswith("DEL frees a big key in one blocking step: use UNLINK")
        assert commandstat(direct, "unlink") == 1 and commandstat(direct, "del") == 1  # the small one stayed DEL
        assert direct.exists("blob:1") == 0
        assert kg.metric('keyguard_bigkey_access_total{kind="del_big_key",command="del",key_pattern="blob:{id}"}') == 1
        counted_and_logged(kg, "del_big_key", "blob:{id}")
        assert kg.metric('keyguard_hygiene_actions_total{kind="del_big_key",action="rewrite"}') == 1
    finally:
        assert kg.stop() == 0


def test_probe_sizes_keys_whose_replies_do_not_show_it(fresh, direct):
    direct.hset("feed:1", mapping={"f%d" % i: i for i in range(6000)})
    direct.hset("feed:2", mapping={"a": 1})
    kg = start(fresh)
    try:
        r = redis.Redis(port=kg.port, decode_responses=True, client_name="feed-svc")
        assert r.hget("feed:1", "f7") == "7"
        assert r.hget("feed:2", "a") == "1"
        [f] = wait_for(lambda: findings(kg, "big_key_access"))
        assert f["key"] == "feed:1" and f["elements"] == 6000 and f["command"] == "hget"
        assert f["client_name"] == "feed-svc" and f["bytes"] > 6000  # MEMORY USAGE
        assert wait_for(lambda: kg.metric("keyguard_probed_keys_total") == 2)
        # What the probe learned makes the next DEL and EXPIRE findings, without another probe.
        counted_and_logged(kg, "big_key_access", "feed:{id}")
        assert kg.metric('keyguard_bigkey_access_total{kind="big_key_access",command="hget",key_pattern="feed:{id}"}') == 1
        assert r.expire("feed:1", 100)
        [e] = findings(kg, "expire_big_key")
        assert e["key"] == "feed:1" and e["elements"] == 6000 and e["ttl_s"] == 100
        assert r.expire("feed:2", 100)
        assert len(findings(kg, "expire_big_key")) == 1
        assert r.delete("feed:1") == 1
        [d] = findings(kg, "del_big_key")
        assert d["elements"] == 6000 and d["action"] == "warn"
        assert commandstat(direct, "del") == 1  # warn only: not rewritten
        assert kg.metric("keyguard_probed_keys_total") == 2
        counted_and_logged(kg, "expire_big_key", "feed:{id}")
        counted_and_logged(kg, "del_big_key", "feed:{id}")
    finally:
        assert kg.stop() == 0


def test_probe_asks_about_the_name_the_server_stores(fresh, direct):
    # Under a key-policy rewrite (and a tenant prefix) the probe asked about the client's old
    # name, found nothing, and big_key_access never fired for rewritten keys.
    direct.hset("t:feed:1", mapping={"f%d" % i: i for i in range(6000)})
    kg = start(fresh, 'tenancy: {prefix: "t:", name: svc}\n'
                      "key_policy:\n  default_action: observe\n  rules:\n"
                      "    - {name: legacy-feed, pattern: '^Feed_(\\d+)$', rewrite: 'feed:$1', action: rewrite}\n")
    try:
        r = redis.Redis(port=kg.port, decode_responses=True)
        assert r.hget("Feed_1", "f7") == "7"  # stored as t:feed:1
        [f] = wait_for(lambda: findings(kg, "big_key_access"))
        assert f["key"] == "Feed_1" and f["elements"] == 6000 and f["tenant"] == "svc"
        assert wait_for(lambda: kg.metric("keyguard_probed_keys_total") == 1)
    finally:
        assert kg.stop() == 0


def test_set_ex_of_a_big_value_is_expire_big_key(fresh, direct):
    kg = start(fresh)
    try:
        r = redis.Redis(port=kg.port)
        r.set("page:1", "x" * 12000, ex=60)
        r.set("page:2", "x" * 100, ex=60)
        [f] = findings(kg, "expire_big_key")
        assert f["key"] == "page:1" and f["bytes"] == 12000 and f["ttl_s"] == 60
        counted_and_logged(kg, "expire_big_key", "page:{id}")
    finally:
        assert kg.stop() == 0


def test_keys_rule_rejects_and_scan_passes(fresh, direct):
    kg = start(fresh, "hygiene:\n  rules:\n    keys_command: {action: reject}\n")
    try:
        r = redis.Redis(port=kg.port)
        r.set("a:1", 1)
        with pytest.raises(redis.ResponseError) as e:
            r.keys("*")
        assert str(e.value) == ("keyguard: keys_command: KEYS blocks the server while it walks every key: use SCAN "
                                "with MATCH and COUNT")
        assert list(r.scan_iter("*")) == [b"a:1"]
        assert commandstat(direct, "keys") == 0
        [f] = findings(kg, "keys_command")
        assert f["action"] == "reject"
        assert kg.metric('keyguard_commands_rejected_total{reason="hygiene"}') == 1
        assert kg.metric('keyguard_hygiene_actions_total{kind="keys_command",action="reject"}') == 1
    finally:
        assert kg.stop() == 0


def test_flush_without_async_is_rewritten(fresh, direct):
    kg = start(fresh, "hygiene:\n  rules:\n    flush_without_async: {action: rewrite}\n")
    try:
        r = redis.Redis(port=kg.port)
        with direct.monitor() as m:
            r.flushdb()
            r.flushdb(asynchronous=True)
            cmds = []
            for ev in m.listen():
                cmds.append(ev["command"])
                if len(cmds) == 2:
                    break
        assert cmds == ["FLUSHDB ASYNC", "FLUSHDB ASYNC"]
        [f] = findings(kg, "flush_without_async")
        assert f["action"] == "rewrite"
    finally:
        assert kg.stop() == 0


# A window no slow machine overruns: an EXPIRE right after its write always falls inside it, and
# the writes still waiting are reported when their connection ends (the window's own end is
# tested apart, with a short window and only a lower bound on time).
TTL_CONFIG = """hygiene:
  missing_ttl_window_ms: 600000
  ttl_patterns:
    - {pattern: "cache:*", kind: cache, default_ttl_s: 600}
    - {pattern: "session:*", kind: session}
"""


def test_missing_ttl_on_cache_and_session_patterns(fresh, direct):
    kg = start(fresh, TTL_CONFIG)
    try:
        r = redis.Redis(port=kg.port)
        r.set("cache:1", "v")                    # no TTL: a finding
        r.set("cache:2", "v")
        r.expire("cache:2", 60)                   # TTL right after on the same connection: fine
        r.set("cache:3", "v", ex=60)              # TTL with the write: fine
        r.set("user:1", "v")                      # not a cache pattern: fine
        r.mset({"session:9": "s", "other": "o"})  # MSET without TTL on a session key: a finding
        assert findings(kg, "missing_ttl") == []  # still inside the window
        r.connection_pool.disconnect()            # the connection's end reports what waited
        fs = wait_for(lambda: len(findings(kg, "missing_ttl")) == 2 and findings(kg, "missing_ttl"))
        assert sorted(f["key"] for f in fs) == ["cache:1", "session:9"], fs
        s = [f for f in fs if f["key"] == "session:9"][0]
        assert s["suggestion"].startswith("session key (session:*) written without a TTL") and s["command"] == "mset"
        assert kg.metric('keyguard_findings_total{kind="missing_ttl",key_pattern="cache:{id}"}') == 1
    finally:
        assert kg.stop() == 0
    assert "missing_ttl" in [line["kind"] for line in kg.events("finding")]


def test_missing_ttl_on_collections_the_write_created(fresh, direct):
    direct.rpush("cache:old-list", "x")          # made before, directly: keeps whatever TTL it has
    direct.hset("cache:old-hash", "f", "v")
    kg = start(fresh, TTL_CONFIG)
    try:
        r = redis.Redis(port=kg.port)
        r.hset("cache:h1", mapping={"f": "v", "g": "w"})  # created without a TTL: a finding
        r.hset("cache:h1", "f", "x")                      # the same key again: still one finding
        r.sadd("cache:s1", "a")
        r.expire("cache:s1", 60)                          # created, then a TTL on the same connection
        with r.pipeline(transaction=True) as p:           # write and TTL in one MULTI
            p.zadd("cache:z1", {"a": 1})
            p.expire("cache:z1", 60)
            p.execute()
        r.rpush("cache:old-list", "y")                    # an existing list: the reply says 2
        r.hset("cache:old-hash", "f", "w")                # an existing field: the reply says 0
        r.zadd("cache:z2", {"a": 1}, xx=True)             # XX never creates
        r.xadd("session:stream", {"f": "v"})              # XADD creates: a finding
        r.lpush("user:1:list", "a")                       # not a ttl pattern
        assert findings(kg, "missing_ttl") == []          # still inside the window
        r.connection_pool.disconnect()
        fs = wait_for(lambda: len(findings(kg, "missing_ttl")) == 2 and findings(kg, "missing_ttl"))
        assert sorted((f["key"], f["command"]) for f in fs) == [("cache:h1", "hset"), ("session:stream", "xadd")], fs
        assert all("created without a TTL: EXPIRE it right after the write" in f["suggestion"] for f in fs), fs
        assert direct.ttl("cache:h1") == -1 and direct.ttl("cache:s1") > 0 and direct.ttl("cache:z1") > 0
    finally:
        assert kg.stop() == 0


def test_missing_ttl_reported_by_the_next_command_after_the_window(fresh, direct):
    kg = start(fresh, TTL_CONFIG.replace("missing_ttl_window_ms: 600000", "missing_ttl_window_ms: 300"))
    try:
        q = RespConn(kg.port)
        assert q.call("SET", "cache:4", "v") == "OK"
        time.sleep(0.4)  # not a synchronisation: at least the window passes, a slow machine only adds to it
        assert q.call("PING") == "PONG"  # the next command on the connection reports what waited
        [f] = findings(kg, "missing_ttl")
        assert f["key"] == "cache:4" and f["command"] == "set"
    finally:
        assert kg.stop() == 0


def test_missing_ttl_rewrite_adds_the_default_ttl(fresh, direct):
    kg = start(fresh, TTL_CONFIG.replace("kind: session}", "kind: session, default_ttl_s: 60}") +
               "  rules:\n    missing_ttl: {action: rewrite}\n")
    try:
        r = redis.Redis(port=kg.port)
        before = server_time(direct)
        r.set("cache:1", "v")
        r.set("user:1", "v")
        assert before + 600 <= expire_times(direct, ["cache:1"])[0] <= server_time(direct) + 600
        assert direct.ttl("user:1") == -1
        [f] = findings(kg, "missing_ttl")
        assert f["action"] == "rewrite" and f["ttl_s"] == 600
    finally:
        assert kg.stop() == 0


def test_missing_ttl_rewrite_needs_a_default(fresh):
    kg_bin = os.environ.get("KEYGUARD_BIN")
    import subprocess
    from conftest import KEYGUARD
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write("hygiene:\n  rules:\n    missing_ttl: {action: rewrite}\n  ttl_patterns:\n    - {pattern: \"c:*\"}\n")
    out = subprocess.run([kg_bin or KEYGUARD, "check-config", path], capture_output=True, text=True)
    assert out.returncode == 2
    assert "hygiene.ttl_patterns[0].default_ttl_s: must be set (> 0) when hygiene.rules.missing_ttl.action is rewrite" \
        in out.stderr
    with open(path, "w") as f:
        f.write("hygiene:\n  rules:\n    big_string_read: {action: reject}\n")
    out = subprocess.run([kg_bin or KEYGUARD, "check-config", path], capture_output=True, text=True)
    assert "hygiene.rules.big_string_read.action: this finding is only known from the reply" in out.stderr


def test_expiry_clustering_found_once_and_jitter_spreads_ttls(fresh, direct):
    kg = start(fresh, "hygiene:\n  expiry_cluster_keys: 50\n")
    try:
        r = redis.Redis(port=kg.port)
        # One absolute expiry second for all of them (EXAT): with EX a slow pipeline could straddle
        # a second boundary and split them over two seconds.
        at = int(server_time(direct)) + 3600
        t0 = time.monotonic()
        p = r.pipeline(transaction=False)
        for i in range(80):
            p.set("tok:%d" % i, "v", exat=at)
        p.execute()
        elapsed = time.monotonic() - t0
        [f] = findings(kg, "expiry_clustering")
        assert f["keys"] == 50 and f["key"].startswith("tok:")
        assert 3600 - elapsed - 2 <= f["ttl_s"] <= 3600, (f["ttl_s"], elapsed)
        counted_and_logged(kg, "expiry_clustering", "tok:{id}")
        assert set(expire_times(direct, ["tok:%d" % i for i in range(80)])) == {at}  # observe only: unchanged
    finally:
        assert kg.stop() == 0
    kg = start(fresh, "hygiene:\n  jitter_percent: 50\n  rules:\n    expiry_clustering: {action: rewrite}\n")
    try:
        r = redis.Redis(port=kg.port)
        before = server_time(direct)
        for i in range(40):
            r.set("j:%d" % i, "v", ex=1000)
        r.expire("j:0", 2000)
        after = server_time(direct)
        expiry = expire_times(direct, ["j:%d" % i for i in range(1, 40)])
        assert all(before + 1000 <= t <= after + 1500 for t in expiry), (before, after, expiry)
        assert len(set(expiry)) > 5  # spread, not all in one second
        [j0] = expire_times(direct, ["j:0"])
        assert before + 2000 <= j0 <= after + 3000
        # Absolute expiries too: up to 50% of the time left later, never sooner.
        at = int(server_time(direct)) + 1000
        for i in range(40):
            r.set("a:%d" % i, "v", exat=at)
        absolute = expire_times(direct, ["a:%d" % i for i in range(40)])
        assert all(at <= t <= at + 501 for t in absolute), (at, absolute)
        assert len(set(absolute)) > 5
        # PXAT, EXPIREAT and PEXPIREAT the same, each in its own unit: the stored expiry (to the
        # millisecond) is the one asked or later, by at most half of what was left.
        at_ms = int(server_time(direct) * 1000) + 1000000
        at = at_ms // 1000
        for i in range(40):
            r.set("px:%d" % i, "v", pxat=at_ms)
            r.set("ea:%d" % i, "v")
            assert r.expireat("ea:%d" % i, at) is True
            r.set("pa:%d" % i, "v")
            assert r.pexpireat("pa:%d" % i, at_ms) is True
        for prefix, asked in (("px", at_ms / 1000), ("ea", at), ("pa", at_ms / 1000)):
            stored = expire_times(direct, ["%s:%d" % (prefix, i) for i in range(40)])
            assert all(asked <= t <= asked + 501 for t in stored), (prefix, asked, stored)
            assert len(set(stored)) > 5, (prefix, stored)
        # EXPIREAT in whole seconds: the jitter keeps the unit, so every expiry is a whole second.
        assert all(t == int(t) for t in expire_times(direct, ["ea:%d" % i for i in range(40)]))
    finally:
        assert kg.stop() == 0


def test_finding_keys_hashed_or_redacted_and_findings_file(fresh):
    path = tempfile.mktemp(suffix=".jsonl")
    kg = start(fresh, "hygiene:\n  finding_keys: hashed\n  findings_file: %s\n" % path)
    try:
        redis.Redis(port=kg.port).keys("secret:customer:42*")
        [f] = findings(kg, "keys_command")
        assert f["key"].startswith("hash:") and len(f["key"]) == 21 and "secret" not in json.dumps(f["key"])
        assert f["key_pattern"] == "secret:customer:{id}*"
    finally:
        assert kg.stop() == 0
    lines = [json.loads(l) for l in open(path)]
    assert [l["kind"] for l in lines] == ["keys_command"] and lines[0]["event"] == "finding"
    assert kg.events("finding") == []  # the log went to the file
    kg = start(fresh, "hygiene:\n  finding_keys: redacted\n")
    try:
        redis.Redis(port=kg.port).keys("secret:*")
        [f] = findings(kg, "keys_command")
        assert f["key"] == "" and f["key_pattern"] == "secret:*"
    finally:
        assert kg.stop() == 0


def test_observe_only_rule_counts_without_logging(fresh):
    kg = start(fresh, "hygiene:\n  rules:\n    keys_command: {action: observe}\n")
    try:
        redis.Redis(port=kg.port).keys("x*")
        [f] = findings(kg, "keys_command")
        assert f["action"] == "observe"
        assert kg.metric('keyguard_findings_total{kind="keys_command",key_pattern="x*"}') == 1
    finally:
        assert kg.stop() == 0
    assert kg.events("finding") == []


def test_findings_carry_the_tenant_and_the_apps_key_name(fresh, direct):
    kg = start(fresh, 'tenancy: {prefix: "svc:", name: checkout}\nhygiene:\n  rules:\n    del_big_key: {action: rewrite}\n')
    try:
        r = redis.Redis(port=kg.port)
        r.set("blob:1", "x" * 20000)
        r.delete("blob:1")
        [f] = findings(kg, "del_big_key")
        assert f["tenant"] == "checkout" and f["key"] == "blob:1"
        assert commandstat(direct, "unlink") == 1 and direct.keys("*") == []
    finally:
        assert kg.stop() == 0
