"""Hot keys, big keys and reply size histograms through keyguard against a real redis-server:
/debug/hotkeys (space-saving sketches by access count and by bytes, per tenant), /debug/bigkeys,
keyguard_hot_key_pattern_accesses, keyguard_reply_bytes and keyguard_reply_elements."""
import json

import redis

from conftest import Keyguard, wait_until

EXACT = "hygiene: {hot_keys_sample: 1}\n"  # count every command: exact counts


def hotkeys(kg, n=20):
    status, body = kg.http("/debug/hotkeys?n=%d" % n)
    assert status == 200, body
    return json.loads(body)


def bigkeys(kg, n=20):
    status, body = kg.http("/debug/bigkeys?n=%d" % n)
    assert status == 200, body
    return json.loads(body)


def poll(fetch, ok):
    """Workers publish once a second: fetch until ok(value) and return that value (the bound is
    conftest's generous one; a passing run returns as soon as the workers have published)."""
    last = []

    def check():
        last[:] = [fetch()]
        return ok(last[0])
    wait_until(check, "the published hot/big keys")
    return last[0]


def resp_len(*args):
    """Bytes of a RESP2 multibulk request, as redis-py sends it."""
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return len(out)


def test_skewed_workload_top_key_exact_count_bytes_and_pattern(fresh):
    kg = Keyguard(fresh.port, config=EXACT, threads=2)
    try:
        r = redis.Redis(port=kg.port)
        hot = "user:1001:views"
        for i in range(50):
            for _ in range(3):
                r.execute_command("INCR", "item:%d" % i)
        for _ in range(1000):
            r.execute_command("INCR", hot)
        h = poll(lambda: hotkeys(kg), lambda h: h["by_count"] and h["by_count"][0]["count"] == 1000)
        assert h["interval_s"] == 60 and h["capacity"] == 256 and h["sample_rate"] == 1 and h["counts_scaled_by"] == 1
        top = h["by_count"][0]
        assert top == {"key": hot, "tenant": None, "key_pattern": "user:{id}:views", "count": 1000, "error": 0}, h
        assert len(h["by_count"]) == 20  # ?n=20 of 51 keys, sorted descending
        assert h["by_count"][1]["count"] == 3 and h["by_count"][1]["key_pattern"] == "item:{id}"
        counts = [e["count"] for e in h["by_count"]]
        assert counts == sorted(counts, reverse=True)
        # Bytes: every request plus its reply (":1\r\n" ... ":1000\r\n"), exact while not sampled.
        expected = 1000 * resp_len("INCR", hot) + sum(len(":%d\r\n" % n) for n in range(1, 1001))
        assert h["by_bytes"][0] == {"key": hot, "tenant": None, "key_pattern": "user:{id}:views",
                                    "count": expected, "error": 0}, h["by_bytes"][0]
        assert len(hotkeys(kg, n=5)["by_count"]) == 5
    finally:
        assert kg.stop() == 0


def test_default_sampling_scales_counts_and_still_finds_the_hot_key(fresh):
    kg = Keyguard(fresh.port, threads=1)
    try:
        r = redis.Redis(port=kg.port)
        p = r.pipeline(transaction=False)
        for i in range(8000):
            p.execute_command("INCR", "user:1:views" if i % 2 == 0 else "item:%d" % i)
        p.execute()
        h = poll(lambda: hotkeys(kg), lambda h: h["by_count"] and h["by_count"][0]["count"] > 2000)
        assert h["sample_rate"] == 0.125 and h["counts_scaled_by"] == 8
        top = h["by_count"][0]
        assert top["key"] == "user:1:views" and 3000 <= top["count"] <= 5000, top  # 4000 true
        assert top["count"] % 8 == 0
    finally:
        assert kg.stop() == 0


def test_big_string_and_big_hash_have_exact_sizes(fresh):
    # The largest keys see the commands hot keys sample: every one with hot_keys_sample: 1.
    kg = Keyguard(fresh.port, config=EXACT, threads=2)
    try:
        r = redis.Redis(port=kg.port)
        r.set("blob:1", b"x" * 50000)
        assert len(r.get("blob:1")) == 50000
        r.hset("profile:big", mapping={"f%d" % i: "v" for i in range(6000)})
        assert len(r.hgetall("profile:big")) == 6000
        r.set("small", "1")
        b = poll(lambda: bigkeys(kg), lambda b: b["by_elements"] and b["by_bytes"])
        blob = [e for e in b["by_bytes"] if e["key"] == "blob:1"]
        assert len(blob) == 1, b
        assert blob[0]["bytes"] == 50000 and blob[0]["type"] == "string" and blob[0]["tenant"] is None
        assert blob[0]["key_pattern"] == "blob:{id}" and blob[0]["command"] in ("set", "get")
        assert blob[0]["last_seen_ms"] > 1.6e12
        assert b["by_bytes"][0]["key"] == "blob:1"  # the largest first
        big = b["by_elements"][0]
        assert {k: big[k] for k in ("key", "type", "elements", "command")} == {
            "key": "profile:big", "type": "hash", "elements": 6000, "command": "hgetall"}, b
        # HLEN tells the same size without reading the hash.
        r.delete("blob:1")
        r.hset("profile:bigger", mapping={"f%d" % i: "v" for i in range(7000)})
        assert r.hlen("profile:bigger") == 7000
        b = poll(lambda: bigkeys(kg), lambda b: b["by_elements"][0]["key"] == "profile:bigger")
        assert b["by_elements"][0]["elements"] == 7000 and b["by_elements"][0]["command"] == "hlen"
    finally:
        assert kg.stop() == 0


def test_tenant_keys_show_the_apps_name_and_the_tenant(fresh):
    kg = Keyguard(fresh.port, config='tenancy: {prefix: "t:", name: "svc"}\n' + EXACT, threads=1)
    try:
        r = redis.Redis(port=kg.port)
        for _ in range(7):
            r.execute_command("INCR", "cart:42")
        r.set("doc:1", b"y" * 20000)
        assert redis.Redis(port=fresh.port).get("t:cart:42") == b"7"  # stored under the prefix
        h = poll(lambda: hotkeys(kg), lambda h: h["by_count"] and h["by_count"][0]["count"] == 7)
        assert h["by_count"][0] == {"key": "cart:42", "tenant": "svc", "key_pattern": "cart:{id}", "count": 7,
                                    "error": 0}, h
        b = poll(lambda: bigkeys(kg), lambda b: b["by_bytes"])
        assert b["by_bytes"][0]["key"] == "doc:1" and b["by_bytes"][0]["tenant"] == "svc"
        assert b["by_bytes"][0]["bytes"] == 20000
    finally:
        assert kg.stop() == 0


def test_interval_closes_and_feeds_the_pattern_metric(fresh):
    # Intervals of 3 s: the closed interval's gauge stays up for 3 s, long enough for a poll on a
    # loaded machine to see it.
    kg = Keyguard(fresh.port, config="hygiene: {hot_keys_interval_s: 3, hot_keys_sample: 1}\n", threads=1)
    try:
        r = redis.Redis(port=kg.port)
        # One pipeline: its replies arrive in one read, so one interval holds all of them.
        p = r.pipeline(transaction=False)
        for _ in range(20):
            p.execute_command("INCR", "user:5:views")
        for _ in range(4):
            p.execute_command("INCR", "job:9")
        p.execute()
        series = 'keyguard_hot_key_pattern_accesses{key_pattern="user:{id}:views"}'
        assert poll(lambda: kg.metric(series), lambda v: v == 20) == 20, kg.metrics()
        assert kg.metric('keyguard_hot_key_pattern_accesses{key_pattern="job:{id}"}') == 4
        assert "# TYPE keyguard_hot_key_pattern_accesses gauge" in kg.metrics()
        # Two intervals later nothing is left of it.
        assert poll(lambda: hotkeys(kg)["by_count"], lambda e: e == []) == []
    finally:
        assert kg.stop() == 0


def test_reply_size_histograms_are_exact(fresh):
    kg = Keyguard(fresh.port, threads=1)
    try:
        r = redis.Redis(port=kg.port)
        r.set("v", b"a" * 100)
        for _ in range(3):
            assert len(r.get("v")) == 100  # "$100\r\n" + 100 + "\r\n" = 108 bytes
        r.rpush("l", *range(30))
        assert len(r.lrange("l", 0, -1)) == 30
        m = kg.metrics()

        def val(series):
            for line in m.splitlines():
                if line.startswith(series + " "):
                    return float(line.split(" ")[-1])
            raise AssertionError("no series " + series)

        assert val('keyguard_reply_bytes_bucket{command="get",le="64"}') == 0
        assert val('keyguard_reply_bytes_bucket{command="get",le="256"}') == 3
        assert val('keyguard_reply_bytes_bucket{command="get",le="+Inf"}') == 3
        assert val('keyguard_reply_bytes_sum{command="get"}') == 3 * 108
        assert val('keyguard_reply_bytes_count{command="get"}') == 3
        assert val('keyguard_reply_bytes_bucket{command="set",le="64"}') == 1  # +OK
        # Elements: aggregates only (GET has none), LRANGE's 30.
        assert 'keyguard_reply_elements_count{command="get"}' not in m
        assert val('keyguard_reply_elements_bucket{command="lrange",le="10"}') == 0
        assert val('keyguard_reply_elements_bucket{command="lrange",le="100"}') == 1
        assert val('keyguard_reply_elements_sum{command="lrange"}') == 30
        assert val('keyguard_reply_elements_count{command="lrange"}') == 1
        assert "# TYPE keyguard_reply_bytes histogram" in m and "# TYPE keyguard_reply_elements histogram" in m
        assert 'keyguard_reply_bytes_count{command="hgetall"}' not in m  # no series for commands not seen
    finally:
        assert kg.stop() == 0


def test_200k_distinct_keys_keep_the_sketch_at_capacity(fresh):
    kg = Keyguard(fresh.port, config="hygiene: {hot_keys_capacity: 256, hot_keys_sample: 1}\n", threads=1)
    try:
        r = redis.Redis(port=kg.port)
        rss_before = kg.rss_kb()
        for batch in range(20):
            p = r.pipeline(transaction=False)
            for i in range(10000):
                p.execute_command("EXISTS", "session:%d" % (batch * 10000 + i))
            p.execute()
        h = poll(lambda: hotkeys(kg), lambda h: h["workers"][0]["by_count"] == 256)
        assert h["workers"] == [{"by_count": 256, "by_bytes": 256, "largest_by_bytes": 0,
                                 "largest_by_elements": 0}], h["workers"]
        # Every key was seen once: no key can claim more than its error says.
        top = h["by_count"][0]
        assert top["key_pattern"] == "session:{id}" and top["count"] - top["error"] <= 1
        assert top["count"] <= 200000 // 256 + 1
        if not __import__("conftest").SANITIZED:
            assert kg.rss_kb() - rss_before < 20000, (rss_before, kg.rss_kb())
    finally:
        assert kg.stop() == 0
