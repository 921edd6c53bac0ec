"""keyguard migrate against a real redis-server: copy (JSON strings to Hashes, nested values as
JSON text or separate keys, plain renames with COPY), verify, cleanup; exact resulting keys, types,
fields and TTLs; idempotent re-runs, resume from the printed cursor, and --dry-run changing
nothing (DEBUG DIGEST before and after)."""
import json
import os
import re
import subprocess
import tempfile
import time

import pytest
import redis

from conftest import KEYGUARD, Redis

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "migrate-profiles.yaml")
CONFIG = r"""
key_policy:
  rules:
    - name: legacy-profile
      pattern: '^User_(\d+)_Profile$'
      rewrite: 'user:$1:profile'
migrations:
  - {name: profiles, match: 'User_*_Profile', rule: legacy-profile, reshape: json_to_hash, batch: 3, max_ops_per_second: 0}
  - {name: profiles-split, match: 'User_*_Profile', rule: legacy-profile, reshape: json_to_hash, nested: separate_key,
     max_ops_per_second: 0}
  - {name: carts, match: 'Cart-*', pattern: '^Cart-(\w+)$', rewrite: 'cart:$1', batch: 2}
"""
ADA = {"name": "ada", "age": 36, "vip": True, "langs": ["en", "fr"], "address": {"city": "Paris", "zip": "75001"}}
BOB = {"name": "bob", "score": 1.5, "nick": None}


@pytest.fixture(scope="module")
def server():
    s = Redis()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def config():
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kg-migrate-")
    with os.fdopen(fd, "w") as f:
        f.write(CONFIG)
    yield path
    os.unlink(path)


@pytest.fixture
def r(server):
    c = redis.Redis(port=server.port, decode_responses=True)
    c.flushall()
    return c


def migrate(server, config, name, step, *args, check=0):
    """Runs one step; the result's `ms` is how long the run took (an upper bound on any delay
    inside it)."""
    start = time.monotonic()
    p = subprocess.run([KEYGUARD, "migrate", "--config", config, "--upstream", "127.0.0.1:%d" % server.port,
                        "--migration", name, step, *args], capture_output=True, text=True, timeout=300)
    p.ms = (time.monotonic() - start) * 1000
    if check is not None:
        assert p.returncode == check, p.stdout + p.stderr
    return p


def expiry(r, key):
    """The key's absolute expiry in unix ms (PEXPIRETIME): fixed while a slow test runs, unlike TTL."""
    return r.execute_command("PEXPIRETIME", key)


def assert_ttl_copied(r, new_key, source_expiry, p):
    """The copy's TTL is the source's as copy read it: it expires no earlier than the source and
    later by at most the time between copy's PTTL and its PEXPIRE, within the run's duration."""
    new = expiry(r, new_key)
    assert source_expiry > 0 and 0 <= new - source_expiry <= p.ms + 1, (new_key, new, source_expiry, p.ms)


def summary(p):
    """The last stdout line as a dict: scanned=3 copied=2 ... -> {"scanned": "3", ...}."""
    return dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split() if "=" in kv)


def fill_profiles(r):
    r.set("User_1_Profile", json.dumps(ADA), px=100000)
    r.set("User_2_Profile", json.dumps(BOB))
    r.set("User_3_Profile", "not json")
    r.hset("User_4_Profile", "name", "dee")                  # a Hash already: not a JSON string
    r.set("User_5_Profile", json.dumps({"name": "eve"}))
    r.hset("user:5:profile", mapping={"name": "eve", "plan": "pro"})  # written by the app already
    r.set("user:6:profile", "unrelated")
    r.set("UserX_Profile", "{}")                              # matches no pattern


def digest(r):
    return r.execute_command("DEBUG", "DIGEST")


def test_dry_run_changes_nothing_and_lists_what_copy_would_write(server, config, r):
    fill_profiles(r)
    before = digest(r)
    p = migrate(server, config, "profiles", "copy", "--dry-run")
    assert digest(r) == before
    lines = p.stdout.strip().splitlines()
    assert sorted(l for l in lines if l.startswith("would")) == [
        "would write user:1:profile (hash, 5 fields, ttl %s ms) from User_1_Profile" % re.search(r"ttl (\d+) ms", p.stdout).group(1),
        "would write user:2:profile (hash, 3 fields, no ttl) from User_2_Profile"]
    assert sorted(l for l in lines if l.startswith("skip")) == [
        "skip User_3_Profile: not valid JSON", "skip User_4_Profile: a hash, not a string"]
    assert summary(p) == {"scanned": "5", "matched": "5", "would_copy": "2", "exists": "1", "skipped": "2",
                          "complete": "true", "cursor": "0"}
    assert p.stdout.strip().splitlines()[-1].startswith("copy profiles: dry-run ")
    migrate(server, config, "profiles", "cleanup", "--dry-run")
    assert digest(r) == before


def test_copy_verify_cleanup_json_to_hash(server, config, r):
    fill_profiles(r)
    p = migrate(server, config, "profiles", "copy")
    assert summary(p) == {"scanned": "5", "matched": "5", "copied": "2", "exists": "1", "skipped": "2",
                          "complete": "true", "cursor": "0"}
    assert r.type("user:1:profile") == "hash"
    assert r.hgetall("user:1:profile") == {"name": "ada", "age": "36", "vip": "true", "langs": '["en","fr"]',
                                           "address": '{"city":"Paris","zip":"75001"}'}
    assert_ttl_copied(r, "user:1:profile", expiry(r, "User_1_Profile"), p)
    assert r.hgetall("user:2:profile") == {"name": "bob", "score": "1.5", "nick": "null"}
    assert r.pttl("user:2:profile") == -1
    assert r.hgetall("user:5:profile") == {"name": "eve", "plan": "pro"}  # never overwritten
    assert not r.exists("user:3:profile") and not r.exists("user:4:profile")
    assert r.get("User_1_Profile") == json.dumps(ADA)  # the old key stays readable

    again = migrate(server, config, "profiles", "copy")
    assert summary(again)["exists"] == "3" and "copied" not in summary(again)

    v = migrate(server, config, "profiles", "verify", check=1)
    # user:5:profile has a field the JSON has not; 3 and 4 were never copied.
    assert sorted(l for l in v.stdout.splitlines() if not l.startswith("verify")) == [
        "differs User_5_Profile -> user:5:profile: extra field 'plan'",
        "missing User_3_Profile -> user:3:profile", "missing User_4_Profile -> user:4:profile"]
    assert summary(v) == {"scanned": "5", "matched": "5", "same": "2", "differ": "1", "missing": "2",
                          "complete": "true", "cursor": "0"}
    r.hset("user:2:profile", "score", "2")
    v = migrate(server, config, "profiles", "verify", check=1)
    assert "differs User_2_Profile -> user:2:profile: field 'score' differs" in v.stdout

    c = migrate(server, config, "profiles", "cleanup")
    assert summary(c) == {"scanned": "5", "matched": "5", "unlinked": "3", "kept": "2", "complete": "true", "cursor": "0"}
    assert sorted(l for l in c.stdout.splitlines() if l.startswith("kept")) == [
        "kept User_3_Profile: user:3:profile does not exist", "kept User_4_Profile: user:4:profile does not exist"]
    assert sorted(r.keys("*")) == ["UserX_Profile", "User_3_Profile", "User_4_Profile", "user:1:profile",
                                   "user:2:profile", "user:5:profile", "user:6:profile"]
    assert summary(migrate(server, config, "profiles", "cleanup"))["kept"] == "2"  # idempotent


def test_nested_values_as_separate_keys(server, config, r):
    r.set("User_1_Profile", json.dumps(ADA), ex=500)
    source_expiry = expiry(r, "User_1_Profile")
    p = migrate(server, config, "profiles-split", "copy")
    assert summary(p)["copied"] == "1"
    assert r.hgetall("user:1:profile") == {"name": "ada", "age": "36", "vip": "true"}
    assert r.type("user:1:profile:address") == "hash"
    assert r.hgetall("user:1:profile:address") == {"city": "Paris", "zip": "75001"}
    assert r.type("user:1:profile:langs") == "string" and r.get("user:1:profile:langs") == '["en","fr"]'
    for k in ("user:1:profile", "user:1:profile:address", "user:1:profile:langs"):
        assert_ttl_copied(r, k, source_expiry, p)
    assert summary(migrate(server, config, "profiles-split", "verify")) == {
        "scanned": "1", "matched": "1", "same": "1", "complete": "true", "cursor": "0"}
    r.delete("user:1:profile:address")
    v = migrate(server, config, "profiles-split", "verify", check=1)
    assert "differs User_1_Profile -> user:1:profile: user:1:profile:address: missing" in v.stdout


def test_plain_rename_keeps_type_value_and_ttl(server, config, r):
    r.rpush("Cart-7", "a", "b", "c")
    r.expire("Cart-7", 300)
    r.zadd("Cart-8", {"x": 1, "y": 2})
    r.set("cart:9", "new")  # an app write through the rewrite rule: copy leaves it alone
    r.set("Cart-9", "old")
    p = migrate(server, config, "carts", "copy")
    assert summary(p) == {"scanned": "3", "matched": "3", "copied": "2", "exists": "1", "complete": "true", "cursor": "0"}
    assert r.type("cart:7") == "list" and r.lrange("cart:7", 0, -1) == ["a", "b", "c"]
    assert_ttl_copied(r, "cart:7", expiry(r, "Cart-7"), p)
    assert r.type("cart:8") == "zset" and r.zrange("cart:8", 0, -1, withscores=True) == [("x", 1.0), ("y", 2.0)]
    assert r.ttl("cart:8") == -1 and r.get("cart:9") == "new"
    v = migrate(server, config, "carts", "verify", check=1)
    assert [l for l in v.stdout.splitlines() if not l.startswith("verify")] == [
        "differs Cart-9 -> cart:9: value differs"]
    assert summary(v)["same"] == "2"
    c = migrate(server, config, "carts", "cleanup")
    assert summary(c)["unlinked"] == "3"
    assert sorted(r.keys("*")) == ["cart:7", "cart:8", "cart:9"]


def test_interrupted_copy_resumes_from_the_printed_cursor(server, config, r):
    pipe = r.pipeline(transaction=False)
    for i in range(60):
        pipe.set("User_%d_Profile" % i, json.dumps({"name": "u%d" % i, "n": i}), ex=1000)
    pipe.execute()
    first = migrate(server, config, "profiles", "copy", "--max-keys", "20")
    s1 = summary(first)
    assert s1["complete"] == "false" and s1["cursor"] != "0"
    assert "resume with --cursor %s" % s1["cursor"] in first.stderr
    assert 20 <= int(s1["copied"]) < 60
    copied = int(s1["copied"])
    assert len(r.keys("user:*:profile")) == copied
    cursor = s1["cursor"]
    while True:
        s = summary(migrate(server, config, "profiles", "copy", "--cursor", cursor, "--max-keys", "20"))
        copied += int(s.get("copied", 0))
        assert s.get("exists", "0") == "0"  # SCAN from the cursor does not revisit finished keys
        cursor = s["cursor"]
        if s["complete"] == "true":
            break
    assert copied == 60 and len(r.keys("user:*:profile")) == 60
    assert r.hgetall("user:42:profile") == {"name": "u42", "n": "42"}
    assert summary(migrate(server, config, "profiles", "verify"))["same"] == "60"


def test_errors_name_the_problem(server, config, r):
    p = migrate(server, config, "nope", "copy", check=2)
    assert "no migration named 'nope' in the config (known: profiles, profiles-split, carts)" in p.stderr
    p = migrate(server, config, "profiles", "rename", check=2)
    assert "name one step: copy, verify or cleanup" in p.stderr


def test_shipped_example_migrates_profiles(server, r):
    r.set("User_1001_Profile", json.dumps({"name": "ada", "age": 36}), ex=100)
    source_expiry = expiry(r, "User_1001_Profile")
    p = migrate(server, EXAMPLE, "profiles", "copy")
    assert summary(p)["copied"] == "1"
    assert r.hgetall("user:1001:profile") == {"name": "ada", "age": "36"}
    assert summary(migrate(server, EXAMPLE, "profiles", "verify"))["same"] == "1"
    assert summary(migrate(server, EXAMPLE, "profiles", "cleanup"))["unlinked"] == "1"
    assert r.keys("*") == ["user:1001:profile"]
    assert_ttl_copied(r, "user:1001:profile", source_expiry, p)
