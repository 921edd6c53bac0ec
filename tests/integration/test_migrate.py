"""keyguard migrate against a real redis-server: copy (JSON strings to Hashes, nested values as
JSON text or separate keys, plain renames with COPY), verify, cleanup; exact resulting keys, types,
fields and expiries; idempotent re-runs, resume from the printed cursor, --dry-run changing
nothing (DEBUG DIGEST before and after), and issue #20: cleanup deletes only old keys that match
their new key at that instant, copy --refresh catches up with a live writer, numbers stay byte for
byte, unconvertible keys are counted apart, and exit codes say what happened."""
import json
import os
import random
import re
import subprocess
import tempfile
import threading
import time

import pytest
import redis

from conftest import KEYGUARD, SANITIZED, Redis

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
  - {name: profiles-skip, match: 'User_*_Profile', rule: legacy-profile, reshape: json_to_hash, unconvertible: skip,
     max_ops_per_second: 0}
  - {name: profiles-asis, match: 'User_*_Profile', rule: legacy-profile, reshape: json_to_hash, unconvertible: copy_unchanged,
     max_ops_per_second: 0}
  - {name: profiles-split, match: 'User_*_Profile', rule: legacy-profile, reshape: json_to_hash, nested: separate_key,
     max_ops_per_second: 0}
  - {name: carts, match: 'Cart-*', pattern: '^Cart-(\w+)$', rewrite: 'cart:$1', batch: 2}
"""
ADA = {"name": "ada", "age": 36, "vip": True, "langs": ["en", "fr"], "address": {"city": "Paris", "zip": "75001"}}
BOB = {"name": "bob", "score": 1.5, "nick": None}
ADA_FIELDS = {"name": "ada", "age": "36", "vip": "true", "langs": '["en","fr"]', "address": '{"city":"Paris","zip":"75001"}'}
BOB_FIELDS = {"name": "bob", "score": "1.5", "nick": "null"}


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
                        "--migration", name, step, *args], capture_output=True, text=True, timeout=600)
    p.ms = (time.monotonic() - start) * 1000
    if check is not None:
        assert p.returncode == check, p.stdout + p.stderr
    return p


def expiry(r, key):
    """The key's absolute expiry in unix ms (PEXPIRETIME): fixed while a slow test runs, unlike TTL."""
    return r.execute_command("PEXPIRETIME", key)


def summary(p):
    """The summary line as a dict: scanned=3 copied=2 ... -> {"scanned": "3", ...}."""
    line = [l for l in p.stdout.strip().splitlines() if " scanned=" in l][-1]
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def lines(p, *prefixes):
    """The per-key lines of a run that start with one of `prefixes`, sorted."""
    return sorted(l for l in p.stdout.splitlines() if l.startswith(prefixes))


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


UNCONVERTIBLE_HINT = " (migrations[].unconvertible: skip or copy_unchanged decides what becomes of it)"


def test_dry_run_changes_nothing_and_reports_by_reason(server, config, r):
    fill_profiles(r)
    before = digest(r)
    p = migrate(server, config, "profiles", "copy", "--dry-run", check=1)
    assert digest(r) == before
    assert lines(p, "would") == ["would copy User_1_Profile -> user:1:profile", "would copy User_2_Profile -> user:2:profile"]
    assert lines(p, "unconvertible", "stale") == [
        "stale User_5_Profile -> user:5:profile: extra field 'plan' (copy --refresh rewrites it from the old key)",
        "unconvertible User_3_Profile: not valid JSON" + UNCONVERTIBLE_HINT,
        "unconvertible User_4_Profile: a hash, not a string" + UNCONVERTIBLE_HINT]
    assert summary(p) == {"scanned": "5", "matched": "5", "would_copy": "2", "stale": "1", "unconvertible.not_json": "1",
                          "unconvertible.wrong_type": "1", "complete": "true", "cursor": "0"}
    assert p.stdout.strip().splitlines()[-1].startswith("copy profiles: dry-run ")
    assert "copy found keys that need attention" in p.stderr

    # With --refresh the stale Hash would be rewritten.
    p = migrate(server, config, "profiles", "copy", "--dry-run", "--refresh", check=1)
    assert lines(p, "would refresh") == ["would refresh User_5_Profile -> user:5:profile: extra field 'plan'"]
    # cleanup --dry-run runs the same checks: nothing is copied yet, so nothing would go.
    c = migrate(server, config, "profiles", "cleanup", "--dry-run", check=1)
    assert lines(c, "kept", "would") == [
        "kept User_1_Profile: user:1:profile does not exist", "kept User_2_Profile: user:2:profile does not exist",
        "kept User_5_Profile: user:5:profile differs: extra field 'plan'"]
    assert digest(r) == before


def test_copy_verify_cleanup_json_to_hash(server, config, r):
    fill_profiles(r)
    source_expiry = expiry(r, "User_1_Profile")
    p = migrate(server, config, "profiles-skip", "copy", check=1)  # user:5:profile is stale
    assert summary(p) == {"scanned": "5", "matched": "5", "copied": "2", "stale": "1", "skipped.not_json": "1",
                          "skipped.wrong_type": "1", "complete": "true", "cursor": "0"}
    assert r.type("user:1:profile") == "hash"
    assert r.hgetall("user:1:profile") == ADA_FIELDS
    assert expiry(r, "user:1:profile") == source_expiry  # PEXPIREAT of the source's own expiry
    assert r.hgetall("user:2:profile") == BOB_FIELDS
    assert r.pttl("user:2:profile") == -1
    assert r.hgetall("user:5:profile") == {"name": "eve", "plan": "pro"}  # never overwritten without --refresh
    assert not r.exists("user:3:profile") and not r.exists("user:4:profile")
    assert r.get("User_1_Profile") == json.dumps(ADA)  # the old key stays readable

    again = migrate(server, config, "profiles-skip", "copy", check=1)
    assert summary(again)["up_to_date"] == "2" and "copied" not in summary(again)

    v = migrate(server, config, "profiles-skip", "verify", check=1)
    assert lines(v, "differs", "missing") == ["differs User_5_Profile -> user:5:profile: extra field 'plan'"]
    assert summary(v) == {"scanned": "5", "matched": "5", "same": "2", "differ": "1", "skipped.not_json": "1",
                          "skipped.wrong_type": "1", "complete": "true", "cursor": "0"}
    r.hset("user:2:profile", "score", "2")
    v = migrate(server, config, "profiles-skip", "verify", check=1)
    assert "differs User_2_Profile -> user:2:profile: field 'score' differs" in v.stdout

    c = migrate(server, config, "profiles-skip", "cleanup", check=1)
    assert summary(c) == {"scanned": "5", "matched": "5", "unlinked": "1", "kept.differs": "2", "skipped.not_json": "1",
                          "skipped.wrong_type": "1", "complete": "true", "cursor": "0"}
    assert lines(c, "kept") == ["kept User_2_Profile: user:2:profile differs: field 'score' differs",
                                "kept User_5_Profile: user:5:profile differs: extra field 'plan'"]
    assert sorted(r.keys("*")) == ["UserX_Profile", "User_2_Profile", "User_3_Profile", "User_4_Profile", "User_5_Profile",
                                   "user:1:profile", "user:2:profile", "user:5:profile", "user:6:profile"]

    # The old keys are the truth while the app writes them: --refresh rewrites the new ones.
    p = migrate(server, config, "profiles-skip", "copy", "--refresh")
    assert lines(p, "refreshed") == []  # routine lines only with --verbose
    assert summary(p)["refreshed"] == "2"
    assert r.hgetall("user:2:profile") == BOB_FIELDS and r.hgetall("user:5:profile") == {"name": "eve"}
    assert summary(migrate(server, config, "profiles-skip", "verify"))["same"] == "2"
    c = migrate(server, config, "profiles-skip", "cleanup")
    assert summary(c)["unlinked"] == "2"
    assert sorted(r.keys("*")) == ["UserX_Profile", "User_3_Profile", "User_4_Profile", "user:1:profile", "user:2:profile",
                                   "user:5:profile", "user:6:profile"]
    assert summary(migrate(server, config, "profiles-skip", "cleanup"))["skipped.not_json"] == "1"  # idempotent


def test_cleanup_deletes_only_old_keys_that_match_their_new_key(server, config, r):
    """Issue #20, item 1: each way an old key can disagree with its new key keeps the old key."""
    for i in range(1, 8):
        r.set("User_%d_Profile" % i, json.dumps({"name": "u%d" % i, "n": i}), ex=1000)
    migrate(server, config, "profiles", "copy")
    r.set("User_1_Profile", json.dumps({"name": "u1", "n": 100}), keepttl=True)  # updated by the app after copy
    r.delete("user:2:profile")
    r.set("user:2:profile", "corrupt")                                           # replaced by a string
    r.hset("user:3:profile", "plan", "pro")                                      # the new app wrote a field
    r.hset("user:4:profile", "n", "40")                                          # the new app changed a field
    r.expire("User_5_Profile", 5000)                                             # the app renewed the old key's TTL
    r.delete("user:6:profile")                                                   # never copied / lost
    before = {k: r.dump(k) for k in r.keys("User_*")}

    d = migrate(server, config, "profiles", "cleanup", "--dry-run", check=1)
    kept = ["kept User_1_Profile: user:1:profile differs: field 'n' differs",
            "kept User_2_Profile: user:2:profile differs: a string, not a hash",
            "kept User_3_Profile: user:3:profile differs: extra field 'plan'",
            "kept User_4_Profile: user:4:profile differs: field 'n' differs",
            "kept User_5_Profile: user:5:profile differs: expiry differs",
            "kept User_6_Profile: user:6:profile does not exist"]
    assert lines(d, "kept", "would") == kept + ["would unlink User_7_Profile"]
    assert summary(d) == {"scanned": "7", "matched": "7", "kept.differs": "5", "kept.missing": "1", "would_unlink": "1",
                          "complete": "true", "cursor": "0"}
    c = migrate(server, config, "profiles", "cleanup", check=1)
    assert lines(c, "kept", "unlinked") == kept
    assert summary(c)["unlinked"] == "1"
    assert "cleanup found keys that need attention" in c.stderr
    assert {k: r.dump(k) for k in r.keys("User_*")} == {k: v for k, v in before.items() if k != "User_7_Profile"}

    # After the switch-over the new keys are the truth: --new-keys-win deletes (and lists) the old
    # keys whose new key exists but differs; one without a new key is still kept.
    superseded = ["unlinked User_%d_Profile: superseded by user:%d:profile, which differs%s (--new-keys-win)" % (i, i, d)
                  for i, d in [(1, ": field 'n' differs"), (2, ": a string, not a hash"), (3, ": extra field 'plan'"),
                               (4, ": field 'n' differs"), (5, ": expiry differs")]]
    d = migrate(server, config, "profiles", "cleanup", "--new-keys-win", "--dry-run", check=1)
    assert lines(d, "would unlink", "kept") == ["kept User_6_Profile: user:6:profile does not exist"] + [
        l.replace("unlinked", "would unlink") for l in superseded]
    c = migrate(server, config, "profiles", "cleanup", "--new-keys-win", check=1)
    assert lines(c, "unlinked", "kept") == ["kept User_6_Profile: user:6:profile does not exist"] + superseded
    assert summary(c) == {"scanned": "6", "matched": "6", "superseded": "5", "kept.missing": "1", "complete": "true", "cursor": "0"}
    assert r.keys("User_*") == ["User_6_Profile"] and r.get("user:2:profile") == "corrupt"


def test_copy_refresh_catches_up_with_writes_and_keeps_expiry(server, config, r):
    """Issue #20, item 2: copy never overwrites silently, --refresh brings stale Hashes up to date."""
    r.set("User_1_Profile", json.dumps({"name": "a", "v": 1}), ex=1000)
    r.set("User_2_Profile", json.dumps({"name": "b", "v": 1}))
    migrate(server, config, "profiles", "copy")
    r.set("User_1_Profile", json.dumps({"name": "a", "v": 2}), ex=2000)
    r.set("User_2_Profile", json.dumps({"v": 2}))
    p = migrate(server, config, "profiles", "copy", check=1)
    assert lines(p, "stale") == [
        "stale User_1_Profile -> user:1:profile: field 'v' differs (copy --refresh rewrites it from the old key)",
        "stale User_2_Profile -> user:2:profile: field 'v' differs (copy --refresh rewrites it from the old key)"]
    assert r.hgetall("user:1:profile") == {"name": "a", "v": "1"}
    p = migrate(server, config, "profiles", "copy", "--refresh", "--verbose")
    assert lines(p, "refreshed") == ["refreshed User_1_Profile -> user:1:profile: field 'v' differs",
                                     "refreshed User_2_Profile -> user:2:profile: field 'v' differs"]
    assert r.hgetall("user:1:profile") == {"name": "a", "v": "2"}
    assert r.hgetall("user:2:profile") == {"v": "2"}
    assert expiry(r, "user:1:profile") == expiry(r, "User_1_Profile") and r.pttl("user:2:profile") == -1
    assert summary(migrate(server, config, "profiles", "verify"))["same"] == "2"
    assert summary(migrate(server, config, "profiles", "cleanup"))["unlinked"] == "2"


def test_numbers_and_escapes_are_byte_exact(server, config, r):
    """Issue #20, item 3: no number goes through a double, and verify compares with the source text."""
    text = ('{"id": 12345678901234567890123, "lat": 88.36768, "neg": -0, "exp": 1E400, "price": 10.10,'
            ' "name": "caf\\u00e9 \\ud83d\\ude00", "tags": [1.50, "x\\u00e9"]}')
    r.set("User_1_Profile", text)
    migrate(server, config, "profiles", "copy")
    got = redis.Redis(port=server.port).hgetall("user:1:profile")
    assert got == {b"id": b"12345678901234567890123", b"lat": b"88.36768", b"neg": b"-0", b"exp": b"1E400",
                   b"price": b"10.10", b"name": "café 😀".encode(), b"tags": b'[1.50,"x\\u00e9"]'}
    assert summary(migrate(server, config, "profiles", "verify"))["same"] == "1"
    r.hset("user:1:profile", "lat", "88.36767999999999")  # what a double round trip writes
    v = migrate(server, config, "profiles", "verify", check=1)
    assert lines(v, "differs") == ["differs User_1_Profile -> user:1:profile: field 'lat' differs"]


def test_unconvertible_keys_are_counted_apart_and_handled_as_configured(server, config, r):
    """Issue #20, item 4: malformed JSON, non-objects, {} and other types are not 'missing'."""
    r.set("User_1_Profile", json.dumps(BOB))
    r.set("User_2_Profile", "not json", ex=500)
    r.set("User_3_Profile", "[1, 2]")
    r.set("User_4_Profile", "{}")
    r.set("User_5_Profile", '{"a": 1, "a": 2}')
    r.rpush("User_6_Profile", "x", "y")
    reasons = {"unconvertible.not_json": "1", "unconvertible.not_object": "1", "unconvertible.empty_object": "1",
               "unconvertible.duplicate_field": "1", "unconvertible.wrong_type": "1"}

    p = migrate(server, config, "profiles", "copy", check=1)
    assert summary(p) == {"scanned": "6", "matched": "6", "copied": "1", **reasons, "complete": "true", "cursor": "0"}
    assert "unconvertible User_5_Profile: the field 'a' appears twice (one value would be lost)" + UNCONVERTIBLE_HINT in p.stdout
    v = migrate(server, config, "profiles", "verify", check=1)
    assert summary(v) == {"scanned": "6", "matched": "6", "same": "1", **reasons, "complete": "true", "cursor": "0"}

    skip = {k.replace("unconvertible.", "skipped."): n for k, n in reasons.items()}
    v = migrate(server, config, "profiles-skip", "verify")
    assert summary(v) == {"scanned": "6", "matched": "6", "same": "1", **skip, "complete": "true", "cursor": "0"}
    c = migrate(server, config, "profiles-skip", "cleanup", "--dry-run")
    assert lines(c, "would", "skipped") == [
        "skipped User_2_Profile: not valid JSON", "skipped User_3_Profile: not a JSON object",
        "skipped User_4_Profile: an empty object", "skipped User_5_Profile: the field 'a' appears twice (one value would be lost)",
        "skipped User_6_Profile: a list, not a string", "would unlink User_1_Profile"]

    p = migrate(server, config, "profiles-asis", "copy")
    assert summary(p) == {"scanned": "6", "matched": "6", "copied": "5", "up_to_date": "1", "complete": "true", "cursor": "0"}
    assert r.get("user:2:profile") == "not json" and expiry(r, "user:2:profile") == expiry(r, "User_2_Profile")
    assert r.get("user:4:profile") == "{}" and r.get("user:5:profile") == '{"a": 1, "a": 2}'
    assert r.lrange("user:6:profile", 0, -1) == ["x", "y"]
    assert summary(migrate(server, config, "profiles-asis", "verify"))["same"] == "6"
    r.rpush("User_6_Profile", "z")
    c = migrate(server, config, "profiles-asis", "cleanup", check=1)
    assert lines(c, "kept") == ["kept User_6_Profile: user:6:profile differs: value differs"]
    assert summary(c)["unlinked"] == "5"
    assert sorted(r.keys("User_*")) == ["User_6_Profile"]


def key_script():
    """kKeyScript, the one script behind every step's decision, as compiled into keyguard."""
    src = open(os.path.join(ROOT, "src", "maintenance", "migrate.cc")).read()
    part = lambda name: src.split(name + '[] = R"lua(', 1)[1].split(')lua";', 1)[0]
    return part("kLuaHelpers") + part("kKeyScript")


def test_the_key_script_decides_atomically_on_what_was_read(server, r):
    """The check that makes copy and cleanup safe under a live writer, deterministically: the
    script is given the old value as migrate read it and acts only while the old key still holds
    exactly that."""
    script = key_script()
    read = '{"name": "a", "v": 1}'
    fields = ["hash", "4", "name", "a", "v", "1"]

    def run(mode, text, *keys):
        return r.eval(script, 2 + len(keys), "User_1_Profile", "user:1:profile", *keys, mode, "json", text, *fields)

    r.set("User_1_Profile", '{"name": "a", "v": 2}')  # written after migrate read `read`
    assert run("copy", read) == ["changed", ""]
    assert not r.exists("user:1:profile")
    r.set("User_1_Profile", read, ex=100)
    assert run("copy", read) == ["copied", ""]
    assert r.hgetall("user:1:profile") == {"name": "a", "v": "1"}
    assert expiry(r, "user:1:profile") == expiry(r, "User_1_Profile")
    r.set("User_1_Profile", '{"name": "a", "v": 2}', keepttl=True)
    assert run("cleanup", read) == ["changed", ""]  # the new value would be lost: keep it
    assert r.exists("User_1_Profile")
    r.set("User_1_Profile", read, keepttl=True)
    r.hset("user:1:profile", "w", "x")
    assert run("cleanup", read) == ["differs", "extra field 'w'"]
    r.hdel("user:1:profile", "w")
    r.persist("user:1:profile")
    assert run("verify", read) == ["differs", "expiry differs"]
    assert run("refresh", read) == ["refreshed", "expiry differs"]
    assert expiry(r, "user:1:profile") == expiry(r, "User_1_Profile")
    assert run("cleanup", read) == ["unlinked", ""]
    assert not r.exists("User_1_Profile")
    assert run("cleanup", read) == ["gone", ""]
    # dump mode: COPY and DUMP on the server, no value crosses the network.
    r.rpush("Cart-1", "a")
    assert r.eval(script, 2, "Cart-1", "cart:1", "copy", "dump") == ["copied", ""]
    r.rpush("Cart-1", "b")
    assert r.eval(script, 2, "Cart-1", "cart:1", "cleanup", "dump") == ["differs", "value differs"]
    assert r.eval(script, 2, "Cart-1", "cart:1", "copy", "dump") == ["stale", "value differs"]
    assert r.eval(script, 2, "Cart-1", "cart:1", "refresh", "dump") == ["refreshed", "value differs"]
    assert r.eval(script, 2, "Cart-1", "cart:1", "cleanup", "dump") == ["unlinked", ""]
    assert r.lrange("cart:1", 0, -1) == ["a", "b"] and not r.exists("Cart-1")


def test_exit_codes_progress_and_json_summary(server, config, r):
    """Issue #20, item 5: 3 for a run stopped early, a progress line with rate and ETA, a JSON summary."""
    pipe = r.pipeline(transaction=False)
    for i in range(40):
        pipe.set("User_%d_Profile" % i, json.dumps({"name": "u%d" % i}))
    pipe.execute()
    out = os.path.join(tempfile.mkdtemp(prefix="kg-migrate-"), "summary.json")
    p = migrate(server, config, "profiles", "copy", "--max-keys", "10", "--summary-json", out, "--progress-seconds", "0", check=3)
    s = json.load(open(out))
    assert s["complete"] is False and s["exit_code"] == 3 and s["cursor"] == summary(p)["cursor"] != "0"
    assert s["step"] == "copy" and s["migration"] == "profiles" and s["counts"] == {"copied": s["scanned"]}
    assert "resume with --cursor %s" % s["cursor"] in p.stderr
    progress = [l for l in p.stderr.splitlines() if l.startswith("copy profiles: ")]
    assert progress and all(re.fullmatch(r"copy profiles: \d+ keys, \d+ keys/s of about 40 \d+%( ETA \d+s)?", l) for l in progress), p.stderr
    p = migrate(server, config, "profiles", "copy", "--summary-json", "-")
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["complete"] is True and s["exit_code"] == 0 and s["counts"]["copied"] + s["counts"]["up_to_date"] == 40
    assert migrate(server, config, "profiles", "verify", "--no-progress", "--progress-seconds", "0").stderr == ""


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
        assert expiry(r, k) == source_expiry
    assert summary(migrate(server, config, "profiles-split", "verify")) == {
        "scanned": "1", "matched": "1", "same": "1", "complete": "true", "cursor": "0"}
    r.delete("user:1:profile:address")
    v = migrate(server, config, "profiles-split", "verify", check=1)
    assert "differs User_1_Profile -> user:1:profile: user:1:profile:address: missing" in v.stdout
    c = migrate(server, config, "profiles-split", "cleanup", check=1)
    assert lines(c, "kept") == ["kept User_1_Profile: user:1:profile differs: user:1:profile:address: missing"]
    migrate(server, config, "profiles-split", "copy", "--refresh")
    assert r.hgetall("user:1:profile:address") == {"city": "Paris", "zip": "75001"}
    assert summary(migrate(server, config, "profiles-split", "cleanup"))["unlinked"] == "1"


def test_plain_rename_keeps_type_value_and_expiry(server, config, r):
    r.rpush("Cart-7", "a", "b", "c")
    r.expire("Cart-7", 300)
    r.zadd("Cart-8", {"x": 1, "y": 2})
    r.set("cart:9", "new")  # an app write through the rewrite rule: copy leaves it alone
    r.set("Cart-9", "old")
    p = migrate(server, config, "carts", "copy", check=1)
    assert summary(p) == {"scanned": "3", "matched": "3", "copied": "2", "stale": "1", "complete": "true", "cursor": "0"}
    assert lines(p, "stale") == ["stale Cart-9 -> cart:9: value differs (copy --refresh rewrites it from the old key)"]
    assert r.type("cart:7") == "list" and r.lrange("cart:7", 0, -1) == ["a", "b", "c"]
    assert expiry(r, "cart:7") == expiry(r, "Cart-7")
    assert r.type("cart:8") == "zset" and r.zrange("cart:8", 0, -1, withscores=True) == [("x", 1.0), ("y", 2.0)]
    assert r.ttl("cart:8") == -1 and r.get("cart:9") == "new"
    v = migrate(server, config, "carts", "verify", check=1)
    assert lines(v, "differs", "missing") == ["differs Cart-9 -> cart:9: value differs"]
    assert summary(v)["same"] == "2"
    r.rpush("Cart-7", "d")  # the app still writes the old name
    c = migrate(server, config, "carts", "cleanup", check=1)
    assert lines(c, "kept") == ["kept Cart-7: cart:7 differs: value differs", "kept Cart-9: cart:9 differs: value differs"]
    assert sorted(r.keys("*")) == ["Cart-7", "Cart-9", "cart:7", "cart:8", "cart:9"]
    migrate(server, config, "carts", "copy", "--refresh")
    assert r.lrange("cart:7", 0, -1) == ["a", "b", "c", "d"] and r.get("cart:9") == "old"
    assert summary(migrate(server, config, "carts", "cleanup"))["unlinked"] == "2"
    assert sorted(r.keys("*")) == ["cart:7", "cart:8", "cart:9"]


def test_a_big_hash_and_set_renamed_compare_equal_to_their_copy(server, config, r):
    """A Hash and a Set past the listpack limits are hash tables: COPY rebuilds the table and DUMP
    then lists the items in another order, so comparing DUMP bytes called every such copy
    different (verify failed and cleanup kept them for ever). They compare by content."""
    r.hset("Cart-h", mapping={"f%d" % i: "v%d" % i for i in range(1000)})
    r.sadd("Cart-s", *["m%d" % i for i in range(1000)])
    assert r.object("encoding", "Cart-h") == "hashtable" and r.object("encoding", "Cart-s") == "hashtable"
    assert summary(migrate(server, config, "carts", "copy"))["copied"] == "2"
    assert r.dump("Cart-h") != r.dump("cart:h") or r.dump("Cart-s") != r.dump("cart:s")
    assert summary(migrate(server, config, "carts", "verify"))["same"] == "2"
    r.hset("Cart-h", "f7", "changed")
    v = migrate(server, config, "carts", "verify", check=1)
    assert lines(v, "differs") == ["differs Cart-h -> cart:h: value differs"]
    c = migrate(server, config, "carts", "cleanup", check=1)
    assert summary(c)["unlinked"] == "1" and sorted(r.keys("*")) == ["Cart-h", "cart:h", "cart:s"]


def test_interrupted_copy_resumes_from_the_printed_cursor(server, config, r):
    pipe = r.pipeline(transaction=False)
    for i in range(60):
        pipe.set("User_%d_Profile" % i, json.dumps({"name": "u%d" % i, "n": i}), ex=1000)
    pipe.execute()
    first = migrate(server, config, "profiles", "copy", "--max-keys", "20", check=3)
    s1 = summary(first)
    assert s1["complete"] == "false" and s1["cursor"] != "0"
    assert "resume with --cursor %s" % s1["cursor"] in first.stderr
    assert 20 <= int(s1["copied"]) < 60
    copied = int(s1["copied"])
    assert len(r.keys("user:*:profile")) == copied
    cursor = s1["cursor"]
    while True:
        p = migrate(server, config, "profiles", "copy", "--cursor", cursor, "--max-keys", "20", check=None)
        s = summary(p)
        assert p.returncode == (0 if s["complete"] == "true" else 3), p.stdout + p.stderr
        copied += int(s.get("copied", 0))
        assert s.get("up_to_date", "0") == "0"  # SCAN from the cursor does not revisit finished keys
        cursor = s["cursor"]
        if s["complete"] == "true":
            break
    assert copied == 60 and len(r.keys("user:*:profile")) == 60
    assert r.hgetall("user:42:profile") == {"name": "u42", "n": "42"}
    assert summary(migrate(server, config, "profiles", "verify"))["same"] == "60"


def test_errors_name_the_problem(server, config, r):
    p = migrate(server, config, "nope", "copy", check=2)
    assert "no migration named 'nope' in the config (known: profiles, profiles-skip, profiles-asis, profiles-split, carts)" in p.stderr
    p = migrate(server, config, "profiles", "rename", check=2)
    assert "name one step: copy, verify or cleanup" in p.stderr
    p = migrate(server, config, "profiles", "cleanup", "--refresh", check=2)
    assert "--refresh applies to copy only" in p.stderr
    p = migrate(server, config, "profiles", "copy", "--new-keys-win", check=2)
    assert "--new-keys-win applies to cleanup only" in p.stderr


def test_shipped_example_migrates_profiles(server, r):
    r.set("User_1001_Profile", json.dumps({"name": "ada", "age": 36}), ex=100)
    source_expiry = expiry(r, "User_1001_Profile")
    p = migrate(server, EXAMPLE, "profiles", "copy")
    assert summary(p)["copied"] == "1"
    assert r.hgetall("user:1001:profile") == {"name": "ada", "age": "36"}
    assert summary(migrate(server, EXAMPLE, "profiles", "verify"))["same"] == "1"
    assert summary(migrate(server, EXAMPLE, "profiles", "cleanup"))["unlinked"] == "1"
    assert r.keys("*") == ["user:1001:profile"]
    assert expiry(r, "user:1001:profile") == source_expiry


# The seeds' scenario (issue #20, Tests): 100,000 legacy profiles among other keys, a writer that
# keeps updating legacy keys through copy, verify and cleanup, then the steps again until they
# converge. Nothing the writer wrote last may be lost, nothing stale may remain.
LIVE_KEYS = int(os.environ.get("MIGRATE_LIVE_KEYS", "20000" if SANITIZED else "100000"))


def profile_text(i, version):
    # Numbers a double cannot hold, so a lossy conversion anywhere fails the comparison.
    return '{"name": "u%d", "version": %d, "balance": %d.%02d0, "id": 1234567890123456789%04d}' % (
        i, version, version, i % 100, i)


def profile_fields(i, version):
    return {"name": "u%d" % i, "version": str(version), "balance": "%d.%02d0" % (version, i % 100),
            "id": "1234567890123456789%04d" % i}


def check_profiles_at_last_version(client, n, last):
    """Every user:I:profile Hash holds the fields of the last version the writer wrote (`last`:
    {I: version}; 0 for a key it never wrote)."""
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.hgetall("user:%d:profile" % i)
    got = pipe.execute()
    wrong = [i for i in range(n) if got[i] != profile_fields(i, last.get(i, 0))]
    assert not wrong, [(i, got[i], last.get(i, 0)) for i in wrong[:5]]


def test_live_writer_through_copy_verify_cleanup(server, config, r):
    pipe = r.pipeline(transaction=False)
    for i in range(LIVE_KEYS):
        pipe.set("User_%d_Profile" % i, profile_text(i, 0), **({"ex": 100000} if i % 10 == 0 else {}))
        if i % 2 == 0:
            pipe.set("other:%d" % i, "x")
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()
    last = {}  # the writer's last version of each key it wrote
    stop = threading.Event()
    hot = list(range(0, LIVE_KEYS, max(1, LIVE_KEYS // 2000)))  # 2,000 keys the app keeps updating

    def writer():
        w = redis.Redis(port=server.port)
        rnd = random.Random(7)
        version = 0
        while not stop.is_set():
            version += 1
            batch = w.pipeline(transaction=False)
            for i in rnd.sample(hot, 50):
                batch.set("User_%d_Profile" % i, profile_text(i, version), **({"ex": 100000 + version} if i % 20 == 0 else {}))
                last[i] = version
            batch.execute()

    t = threading.Thread(target=writer)
    t.start()
    try:
        copy = migrate(server, config, "profiles-skip", "copy", "--no-progress", check=None)
        assert copy.returncode in (0, 1) and int(summary(copy).get("copied", 0)) > 0, copy.stdout[-2000:] + copy.stderr
        for _ in range(2):
            refresh = migrate(server, config, "profiles-skip", "copy", "--refresh", "--no-progress", check=None)
            assert refresh.returncode in (0, 1), refresh.stdout[-2000:] + refresh.stderr
        verify = migrate(server, config, "profiles-skip", "verify", "--no-progress", check=None)
        assert verify.returncode in (0, 1), verify.stderr
        cleanup = migrate(server, config, "profiles-skip", "cleanup", "--no-progress", check=None)
        assert cleanup.returncode in (0, 1) and int(summary(cleanup).get("unlinked", 0)) > 0, cleanup.stderr
    finally:
        stop.set()
        t.join()
    assert last, "the writer wrote nothing"
    # The app has stopped writing the old names: the steps converge.
    for _ in range(3):
        migrate(server, config, "profiles-skip", "copy", "--refresh", "--no-progress")
        if migrate(server, config, "profiles-skip", "cleanup", "--no-progress", check=None).returncode == 0:
            break
    assert summary(migrate(server, config, "profiles-skip", "verify", "--no-progress"))["matched"] == "0"
    assert r.keys("User_*") == []
    assert r.dbsize() == LIVE_KEYS + (LIVE_KEYS + 1) // 2
    raw = redis.Redis(port=server.port, decode_responses=True)
    check_profiles_at_last_version(raw, LIVE_KEYS, last)
    # Expiries: the untouched keys with a TTL kept it, keys the writer gave a new TTL have that one.
    pipe = raw.pipeline(transaction=False)
    for i in range(0, LIVE_KEYS, 10):
        pipe.pttl("user:%d:profile" % i)
    for i, pttl in zip(range(0, LIVE_KEYS, 10), pipe.execute()):
        assert pttl > 0 or (i % 20 != 0 and last.get(i, 0) > 0), (i, pttl)
