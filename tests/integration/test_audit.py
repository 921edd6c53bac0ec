"""keyguard audit against a real redis-server filled by the test: good and bad names, big keys,
keys without TTL, idle keys, serialized strings. Exact results in json, prom and table formats,
sampling, a key budget resumed from the printed cursor, rate capping and --fail-on."""
import json
import os
import subprocess
import tempfile
import time

import pytest
import redis

from conftest import KEYGUARD, Redis

# Seconds: the fixture makes every key idle for IDLE seconds (RESTORE ... IDLETIME) and then
# touches HOT; whatever time a slow machine takes before the audit stays far under COLD.
COLD = "1000"
IDLE = 100000
CONFIG = r"""
key_policy:
  rules:
    - name: legacy-profile
      pattern: '^User_(\d+)_Profile$'
      rewrite: 'user:$1:profile'
audit:
  scan_count: 4            # several SCAN batches even for a small keyspace
  max_ops_per_second: 0
"""
FLAT = {"name": "cy", "age": 29, "plan": "pro"}
NESTED = {"name": "di", "address": {"city": "Oslo", "geo": {"lat": 59.9}}}
PICKLE = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94."
KEYS = ["user:1:profile", "user:2:profile", "session:abc", "User_1001_Profile", "User_1002_Profile", "Cart Items",
        "big:list", "big:blob", "cache:obj:7"]
HOT = ["user:1:profile", "session:abc"]  # touched after the keys were made idle


def fill(r):
    r.hset("user:1:profile", mapping={"name": "ada", "age": 36})
    r.expire("user:1:profile", 1000)
    r.hset("user:2:profile", mapping={"name": "bob", "age": 41})
    r.expire("user:2:profile", 1000)
    r.set("session:abc", "token", ex=600)
    r.set("User_1001_Profile", json.dumps(FLAT))
    r.set("User_1002_Profile", json.dumps(NESTED))
    # Not a small integer: with maxmemory-policy noeviction Redis stores 0..9999 as shared objects,
    # whose OBJECT IDLETIME is the shared object's, not the key's.
    r.set("Cart Items", "three")
    r.rpush("big:list", *range(6000))
    r.set("big:blob", "x" * 20000, ex=3600)
    r.set("cache:obj:7", PICKLE)


@pytest.fixture(scope="module")
def data():
    """db 1..3 filled alike, every key made idle, two keys touched: one db per format, because
    reading values (STRLEN, GETRANGE) resets OBJECT IDLETIME on Redis 7.0."""
    server = Redis()
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kg-audit-")
    with os.fdopen(fd, "w") as f:
        f.write(CONFIG)
    for db in (1, 2, 3):
        r = redis.Redis(port=server.port, db=db)
        fill(r)
        for key in KEYS:  # idle for IDLE seconds, without waiting for it
            ttl = r.pttl(key)
            r.restore(key, max(ttl, 0), r.dump(key), replace=True, idletime=IDLE)
    for db in (1, 2, 3):
        r = redis.Redis(port=server.port, db=db)
        r.hget("user:1:profile", "name")
        r.get("session:abc")
    yield server, path
    server.stop()
    os.unlink(path)


def audit(server, path, *args, check=None):
    p = subprocess.run([KEYGUARD, "audit", "--config", path, "--upstream", "127.0.0.1:%d" % server.port, *args],
                       capture_output=True, text=True, timeout=300)
    if check is not None:
        assert p.returncode == check, p.stderr
    return p


def memory(r, key):
    return r.memory_usage(key, samples=5)


def test_json_report_is_exact(data):
    server, path = data
    r = redis.Redis(port=server.port, db=1)
    expected_memory = {k: memory(r, k) for k in KEYS}  # MEMORY USAGE does not touch the key
    p = audit(server, path, "--db", "1", "--format", "json", "--cold-after", COLD, "--top", "3", check=0)
    j = json.loads(p.stdout)
    assert (j["scanned"], j["sampled"], j["dbsize"], j["complete"], j["cursor"]) == (9, 9, 9, True, "0")
    assert j["cold_by"] == "object_idletime"
    assert j["memory"] == sum(expected_memory.values())

    patterns = {p["pattern"]: p for p in j["patterns"]}
    assert sorted(patterns) == ["Cart Items", "User_{id}_Profile", "big:blob", "big:list", "cache:obj:{id}",
                                "session:abc", "user:{id}:profile"]
    profiles = patterns["User_{id}_Profile"]
    legacy_memory = expected_memory["User_1001_Profile"] + expected_memory["User_1002_Profile"]
    assert profiles["keys"] == 2 and profiles["memory"] == legacy_memory
    assert profiles["no_ttl_keys"] == 2 and profiles["no_ttl_memory"] == legacy_memory
    assert profiles["no_ttl_memory_share"] == 1.0 and profiles["types"] == {"string": {"keys": 2, "memory": legacy_memory}}
    users = patterns["user:{id}:profile"]
    assert users["keys"] == 2 and users["no_ttl_keys"] == 0 and users["cold_keys"] == 1
    assert users["types"] == {"hash": {"keys": 2, "memory": expected_memory["user:1:profile"] + expected_memory["user:2:profile"]}}
    assert patterns["big:list"]["no_ttl_keys"] == 1 and patterns["big:blob"]["no_ttl_keys"] == 0

    # Each key once, under the first rule it breaks: the legacy keys under the rule written for
    # them (not again under lowercase), "Cart Items" under lowercase with the others it breaks.
    naming = {n["rule"]: n for n in j["naming"]}
    assert sorted(naming) == ["legacy-profile", "lowercase"]
    legacy = sorted((e["key"], e["suggestion"], e["also"]) for e in naming["legacy-profile"]["examples"])
    assert legacy == [("User_1001_Profile", "user:1001:profile", ["lowercase"]),
                      ("User_1002_Profile", "user:1002:profile", ["lowercase"])]
    assert naming["legacy-profile"]["keys"] == 2 and naming["lowercase"]["keys"] == 1
    assert naming["lowercase"]["patterns"] == {"Cart Items": 1}
    assert [(e["key"], e["suggestion"], e["also"]) for e in naming["lowercase"]["examples"]] == [
        ("Cart Items", "cart items", ["charset", "forbidden_characters"])]

    assert [(b["type"], b["keys"], b["examples"][0]["key"], b["examples"][0]["size"]) for b in j["big_keys"]] == [
        ("list", 1, "big:list", 6000), ("string", 1, "big:blob", 20000)]
    assert j["huge_strings"]["keys"] == 0

    cold = sorted(e["key"] for e in j["cold_keys"]["examples"])
    assert cold == sorted(set(KEYS) - set(HOT)) and j["cold_keys"]["keys"] == 7
    assert all(e["idle_seconds"] >= IDLE for e in j["cold_keys"]["examples"])

    assert j["serialized"]["hash_candidates"] == {"json_object": 1, "python_pickle": 1}
    assert j["serialized"]["json_documents"] == 1
    assert sorted((e["key"], e["format"], e["suggestion"]) for e in j["serialized"]["examples"]) == [
        ("User_1001_Profile", "json_object", "hash"), ("User_1002_Profile", "json_object", "json"),
        ("cache:obj:7", "python_pickle", "hash")]

    top = sorted(KEYS, key=lambda k: -expected_memory[k])[:3]
    assert [t["key"] for t in j["top_keys"]] == top
    assert [t["memory"] for t in j["top_keys"]] == [expected_memory[k] for k in top]
    # warning: 3 names (2 legacy, "Cart Items"), 2 big keys, 2 serialized;
    # info: 5 keys without TTL, 7 cold, 1 JSON document.
    assert j["findings"] == {"critical": 0, "warning": 7, "info": 13}


def test_prometheus_text_passes_promtool_and_has_exact_series(data):
    server, path = data
    r = redis.Redis(port=server.port, db=2)
    blob = memory(r, "big:blob")
    p = audit(server, path, "--db", "2", "--format", "prom", "--cold-after", COLD, check=0)
    check = subprocess.run(["promtool", "check", "metrics"], input=p.stdout, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    lines = set(p.stdout.splitlines())
    for series in ['keyguard_audit_scanned_keys 9', 'keyguard_audit_complete 1',
                   'keyguard_audit_keys{key_pattern="User_{id}_Profile",type="string"} 2',
                   'keyguard_audit_memory_bytes{key_pattern="big:blob",type="string"} %d' % blob,
                   'keyguard_audit_keys_without_ttl{key_pattern="User_{id}_Profile"} 2',
                   'keyguard_audit_keys_without_ttl{key_pattern="big:blob"} 0',
                   'keyguard_audit_memory_without_ttl_bytes{key_pattern="big:blob"} 0',
                   'keyguard_audit_cold_keys{key_pattern="user:{id}:profile"} 1',
                   'keyguard_audit_cold_keys{key_pattern="session:abc"} 0',
                   'keyguard_audit_naming_violations{rule="legacy-profile",key_pattern="User_{id}_Profile"} 2',
                   'keyguard_audit_naming_violations{rule="lowercase",key_pattern="Cart Items"} 1',
                   'keyguard_audit_big_keys{type="list",key_pattern="big:list"} 1',
                   'keyguard_audit_serialized_keys{format="python_pickle",suggestion="hash",key_pattern="cache:obj:{id}"} 1',
                   'keyguard_audit_serialized_keys{format="json_object",suggestion="json",key_pattern="User_{id}_Profile"} 1',
                   'keyguard_audit_findings{severity="warning"} 7', 'keyguard_audit_findings{severity="info"} 13']:
        assert series in lines, series
    # The legacy keys are not counted a second time under the built-in lowercase rule.
    assert not [l for l in lines if l.startswith('keyguard_audit_naming_violations{rule="lowercase",key_pattern="User_')]


def test_table_and_fail_on(data):
    server, path = data
    p = audit(server, path, "--db", "3", "--cold-after", COLD, "--fail-on", "warning", check=1)
    out = p.stdout
    assert out.startswith("keyguard audit of 127.0.0.1:%d db 3: 9 keys scanned of 9 in " % server.port)
    assert ", complete\n" in out.splitlines(keepends=True)[0]
    for fragment in ["legacy-profile 2    User_100", " user:1001:profile lowercase\n",
                     "lowercase      1    Cart Items        cart items        charset, forbidden_characters\n",
                     "big:list 6000 members",
                     "json_object   1    User_1001_Profile a Hash, one field per attribute (warning)\n",
                     "python_pickle 1    cache:obj:7       a Hash, one field per attribute (warning)\n",
                     "json_document 1    User_1002_Profile the JSON type: nested 3 deep (info)\n",
                     "findings: 0 critical, 7 warning, 13 info"]:
        assert fragment in out, fragment + "\n" + out
    # The same findings gate a CI job only at the chosen severity.
    assert audit(server, path, "--db", "3", "--fail-on", "critical").returncode == 0
    assert audit(server, path, "--db", "3", "--fail-on", "never").returncode == 0


def fnv1a(key):
    h = 1469598103934665603
    for c in key.encode():
        h = ((h ^ c) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.fixture(scope="module")
def many(data):
    server, path = data
    r = redis.Redis(port=server.port, db=4)
    pipe = r.pipeline(transaction=False)
    for i in range(300):
        pipe.set("item:%d" % i, "v")
    pipe.execute()
    return server, path


def test_key_budget_stops_and_the_printed_cursor_resumes(many):
    server, path = many
    first = audit(server, path, "--db", "4", "--format", "json", "--count", "50", "--max-keys", "100", check=0)
    a = json.loads(first.stdout)
    assert a["complete"] is False and 100 <= a["scanned"] < 300 and a["cursor"] != "0"
    assert "resume with --cursor %s" % a["cursor"] in first.stderr
    second = audit(server, path, "--db", "4", "--format", "json", "--count", "50", "--cursor", a["cursor"], check=0)
    b = json.loads(second.stdout)
    assert b["complete"] is True and b["start_cursor"] == a["cursor"]
    # SCAN over a keyspace that does not change returns every key once.
    assert a["scanned"] + b["scanned"] == 300
    assert a["patterns"][0]["keys"] + b["patterns"][0]["keys"] == 300


def test_sampling_looks_at_the_keys_a_hash_picks(many):
    server, path = many
    p = audit(server, path, "--db", "4", "--format", "json", "--sample", "0.25", check=0)
    j = json.loads(p.stdout)
    picked = sum(1 for i in range(300) if fnv1a("item:%d" % i) % 1000000 < 250000)
    assert j["scanned"] == 300 and j["sampled"] == picked and j["patterns"][0]["keys"] == picked


def test_rate_cap_spaces_the_commands(many):
    server, path = many
    start = time.monotonic()
    p = audit(server, path, "--db", "4", "--format", "json", "--count", "100", "--rate", "2000", check=0)
    elapsed = time.monotonic() - start
    j = json.loads(p.stdout)
    # 300 keys: 4 commands each, then STRLEN and two GETRANGEs, plus the SCANs: about 2100 commands.
    # The last batch goes out when the ones before it fit the cap.
    last_batch = 100 * 3
    assert j["commands"] > 2000
    assert elapsed >= (j["commands"] - last_batch) / 2000.0 * 0.95, (elapsed, j["commands"])
