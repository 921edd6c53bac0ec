"""Hygiene detectors through keyguard against a real redis-server, on by default: serialized
read-modify-write (and its HSET fix, which finds nothing), lost updates between two connections,
big keys, whole-collection reads, KEYS and FLUSHALL; checked in /metrics and /debug/findings."""
import json
import threading

import redis

from conftest import Keyguard


# Read-modify-write and one-attribute-per-key look back over rmw_window_ms (10 s by default): a
# window no stalled test run can overrun, so the outcome never depends on the machine's speed.
WIDE = "hygiene: {rmw_window_ms: 600000}\n"


def findings(kg):
    status, body = kg.http("/debug/findings")
    assert status == 200
    return json.loads(body)["findings"]


def test_json_profile_rmw_is_one_finding_and_hash_version_none(fresh):
    kg = Keyguard(fresh.port, config=WIDE, threads=1)
    try:
        r = redis.Redis(port=kg.port, client_name="profile-svc")
        profile = {"name": "ada", "age": 36, "city": "Paris", "langs": ["en", "fr"], "plan": "pro", "score": 10,
                   "team": "core", "tz": "CET", "email": "a@x.io", "phone": "1", "vip": False, "tags": {"a": 1}}
        r.set("user:1001:profile", json.dumps(profile))
        # The anti-pattern: read the blob, change one field, write it all back.
        p = json.loads(r.get("user:1001:profile"))
        p["score"] += 1
        r.set("user:1001:profile", json.dumps(p))
        # The fix: a Hash, one field updated in place.
        r.hset("user:1002:profile", mapping={"name": "bob", "score": 10})
        r.hincrby("user:1002:profile", "score", 1)
        r.hgetall("user:1002:profile")
        fs = [f for f in findings(kg) if f["kind"] == "serialized_rmw"]
        assert len(fs) == 1, findings(kg)
        f = fs[0]
        assert f["key"] == "user:1001:profile" and f["key_pattern"] == "user:{id}:profile"
        assert f["format"] == "json_object" and f["fields_changed"] == 1 and f["fields_total"] == 12
        assert f["suggestion"].startswith("changed 1 of 12 fields: store it as a Hash")
        assert f["command"] == "set" and f["client_name"] == "profile-svc"
        assert kg.metric('keyguard_findings_total{kind="serialized_rmw",key_pattern="user:{id}:profile"}') == 1
        assert "serialized_rmw" in [line["kind"] for line in kg.events("finding")]
    finally:
        assert kg.stop() == 0


def test_two_racing_writers_are_a_lost_update_risk(fresh):
    kg = Keyguard(fresh.port, config=WIDE, threads=1)
    try:
        a, b = redis.Redis(port=kg.port), redis.Redis(port=kg.port)
        a.set("cart:7", json.dumps({"items": 1}))
        va, vb = json.loads(a.get("cart:7")), json.loads(b.get("cart:7"))
        va["items"] += 1
        a.set("cart:7", json.dumps(va))
        vb["items"] += 10
        b.set("cart:7", json.dumps(vb))  # a's update is gone
        kinds = [f["kind"] for f in findings(kg)]
        assert kinds == ["serialized_rmw", "serialized_rmw", "lost_update_risk"], kinds
        # The same race with WATCH/MULTI is optimistic locking, not a lost update.
        with a.pipeline() as pa:
            pa.watch("cart:7")
            pa.get("cart:7")
            b.get("cart:7")
            b.set("cart:7", json.dumps({"items": 5}))
            pa.multi()
            pa.set("cart:7", json.dumps({"items": 6}))
            try:
                pa.execute()
            except redis.WatchError:
                pass
        assert [f["kind"] for f in findings(kg)].count("lost_update_risk") == 1
    finally:
        assert kg.stop() == 0


def test_races_between_connections_on_different_workers_are_seen(fresh):
    # Four workers: the kernel spreads the connections, so most pairs below straddle two workers.
    # Every race must be seen, whichever workers its connections landed on.
    kg = Keyguard(fresh.port, config=WIDE, threads=4)
    try:
        pairs = [(redis.Redis(port=kg.port), redis.Redis(port=kg.port)) for _ in range(12)]
        for i, (a, b) in enumerate(pairs):
            key = "cart:%d" % i
            a.set(key, json.dumps({"items": 1}))
            va, vb = json.loads(a.get(key)), json.loads(b.get(key))
            a.set(key, json.dumps({"items": va["items"] + 1}))
            b.set(key, json.dumps({"items": vb["items"] + 10}))  # a's update is gone
        # One attribute per key, each attribute written by another pair's connection.
        for i, (a, b) in enumerate(pairs[:3]):
            a.set("user:9:%s" % ["name", "age", "city"][i], "x")
        kinds = [f["kind"] for f in findings(kg)]
        assert kinds.count("serialized_rmw") == 24, kinds
        assert kinds.count("lost_update_risk") == 12, kinds
        assert kinds.count("hash_candidate") == 1, kinds
        assert kg.metric('keyguard_findings_total{kind="lost_update_risk",key_pattern="cart:{id}"}') == 12
    finally:
        assert kg.stop() == 0


def test_big_keys_whole_collection_reads_keys_and_flush(fresh):
    kg = Keyguard(fresh.port, config="hygiene:\n  big_collection_elements: 100\n", threads=1)
    try:
        r = redis.Redis(port=kg.port)
        r.set("blob:1", "x" * 20000)
        r.set("small:1", "x" * 100)
        assert len(r.get("blob:1")) == 20000
        r.hset("user:9:settings", mapping={"f%d" % i: i for i in range(150)})
        r.sadd("team:3:members", *range(99))
        assert len(r.hgetall("user:9:settings")) == 150
        assert len(r.smembers("team:3:members")) == 99  # under the threshold
        r.keys("user:*")
        r.flushall(asynchronous=True)
        r.execute_command("FLUSHDB")
        got = [(f["kind"], f["key"], f.get("bytes", f.get("elements"))) for f in findings(kg)]
        assert got == [("big_string_write", "blob:1", 20000), ("big_string_read", "blob:1", 20000),
                       ("whole_collection_read", "user:9:settings", 150), ("keys_command", "user:*", None),
                       ("flush_without_async", "", None)], got
        m = kg.metric
        assert m('keyguard_bigkey_access_total{kind="big_string_write",command="set",key_pattern="blob:{id}"}') == 1
        assert m('keyguard_bigkey_access_total{kind="big_string_read",command="get",key_pattern="blob:{id}"}') == 1
        assert m('keyguard_bigkey_access_total{kind="whole_collection_read",command="hgetall",'
                 'key_pattern="user:{id}:settings"}') == 1
        assert m('keyguard_findings_total{kind="keys_command",key_pattern="user:*"}') == 1
        assert m('keyguard_findings_total{kind="flush_without_async",key_pattern=""}') == 1
    finally:
        assert kg.stop() == 0


def test_detectors_off(fresh):
    kg = Keyguard(fresh.port, config="hygiene: {enabled: false}\n")
    try:
        r = redis.Redis(port=kg.port)
        r.set("blob:1", "x" * 20000)
        r.keys("*")
        assert findings(kg) == []
    finally:
        assert kg.stop() == 0


def test_one_attribute_per_key_is_a_hash_candidate(fresh):
    kg = Keyguard(fresh.port, config=WIDE, threads=1)
    try:
        r = redis.Redis(port=kg.port)
        r.set("user:1:name", "ada")
        r.set("user:1:age", "36")
        r.set("user:2:name", "bob")
        r.set("user:1:favor", "tea")
        r.set("user:1:email", "a@x.io")
        got = [(f["kind"], f["key"], f["suggestion"]) for f in findings(kg)]
        assert got == [("hash_candidate", "user:1",
                        "one attribute per key: keep them in one Hash, HSET user:1 name ... age ... favor ...")], got
        assert kg.metric('keyguard_findings_total{kind="hash_candidate",key_pattern="user:{id}"}') == 1
    finally:
        assert kg.stop() == 0
