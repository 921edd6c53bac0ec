"""Key-name policy through keyguard against a real redis-server: the shipped examples, rejects in
pipelines and MULTI, rewrites of multi-key commands (checked against the keys Redis really
stores), warn log lines, and exact violation metrics."""
import os
import subprocess

import pytest
import redis

from conftest import KEYGUARD, ROOT, Keyguard, wait_until
from resp import RespConn, encode


def example(name):
    with open(os.path.join(ROOT, "examples", name)) as f:
        return f.read()


def direct(server):
    return redis.Redis(port=server.port)


def test_strict_example_rejects_with_rule_and_suggestion(fresh):
    kg = Keyguard(fresh.port, config=example("strict.yaml"))
    try:
        c = RespConn(kg.port)
        out = c.exchange(encode("SET", "user:1001:profile", "x") + encode("SET", "User_1001_Profile", "x") +
                         encode("GET", "user:1001:profile") + encode("SET", "cart items", "1"), replies=4)
        assert out == b"+OK\r\n" \
                      b"-ERR keyguard: key 'User_1001_Profile' violates rule 'lowercase': use user:1001:profile\r\n" \
                      b"$1\r\nx\r\n" \
                      b"-ERR keyguard: key 'cart items' violates rules 'charset', 'forbidden_characters'\r\n"
        assert direct(fresh).keys("*") == [b"user:1001:profile"]
        assert kg.metric('keyguard_key_violations_total{rule="lowercase",action="reject",'
                         'key_pattern="User_{id}_Profile"}') == 1
        assert kg.metric('keyguard_commands_rejected_total{reason="key_policy"}') == 2
        assert kg.metric('keyguard_commands_total{command="set",outcome="rejected"}') == 2
        # A refused key inside MULTI fails the transaction as Redis fails a bad queued command.
        out = c.exchange(encode("MULTI") + encode("SET", "user:1:a", "1") + encode("SET", "BAD", "1") + encode("EXEC"),
                         replies=4)
        assert out == b"+OK\r\n+QUEUED\r\n-ERR keyguard: key 'BAD' violates rule 'lowercase': use bad\r\n" \
                      b"-EXECABORT Transaction discarded because of previous errors.\r\n"
        assert direct(fresh).get("user:1:a") is None
    finally:
        assert kg.stop() == 0


SORT_BYPASSES = [
    ("STORE", "get", "STORE", "Bad_Key"),
    ("STORE", "by", "STORE", ""),
    ("STORE", "limit", "asc", "STORE", "Bad Key*"),
]


@pytest.mark.not_cluster(reason='SORT list:a ... STORE list:b: a destination in another slot than the source is CROSSSLOT, as on a cluster node')
@pytest.mark.parametrize("options", SORT_BYPASSES, ids=range(len(SORT_BYPASSES)))
def test_strict_sort_and_georadius_judge_the_destination_the_server_writes(fresh, options):
    # #19 bypass 1 and 2: SORT's STORE followed sortGetKeys (which does not skip STORE's argument),
    # and GEORADIUS took every argument after any STORE word for a key.
    kg = Keyguard(fresh.port, config=example("strict.yaml"))
    try:
        c = RespConn(kg.port)
        assert c.call("RPUSH", "list:a", "3", "1", "2") == 3
        bad = c.call("SORT", "list:a", *options)
        assert isinstance(bad, Exception) and "ERR keyguard: key '%s' violates rule" % options[-1] in str(bad), bad
        out = c.exchange(encode("MULTI") + encode("SORT", "list:a", *options) + encode("EXEC"), replies=3)
        assert out.endswith(b"-EXECABORT Transaction discarded because of previous errors.\r\n"), out
        # The mirror image: a good destination after a decoy is not refused for the decoy.
        assert c.call("SORT", "list:a", "STORE", "GET", "STORE", "list:b") == 3
        assert c.call("GEOADD", "geo:a", "13.361389", "38.115556", "palermo") == 1
        assert c.call("GEORADIUS", "geo:a", "13", "38", "500", "km", "STORE", "store", "ASC") == 1
        assert sorted(direct(fresh).keys("*")) == [b"geo:a", b"list:a", b"list:b", b"store"]
    finally:
        assert kg.stop() == 0


@pytest.mark.not_cluster(reason='RENAME User_1001_Profile user:1001:profile: the two names are in different slots, CROSSSLOT as on a cluster node')
def test_strict_refuses_only_the_names_a_command_creates(fresh):
    # #19: every rule applied to every command, so reading, expiring or deleting an existing
    # non-conforming key was refused, and so was the fix itself (RENAME to a good name).
    d = direct(fresh)
    d.set("User_1001_Profile", "old")
    d.set("User_1002_Profile", "old")
    kg = Keyguard(fresh.port, config=example("strict.yaml"))
    try:
        c = RespConn(kg.port)
        out = c.exchange(b"".join(encode(*a) for a in [
            ("GET", "User_1001_Profile"), ("EXISTS", "User_1001_Profile"), ("TTL", "User_1001_Profile"),
            ("WATCH", "User_1001_Profile"), ("UNWATCH",), ("EXPIRE", "User_1001_Profile", "100"),
            ("PERSIST", "User_1001_Profile"), ("TYPE", "User_1001_Profile"),
            ("RENAME", "User_1001_Profile", "user:1001:profile"), ("DEL", "User_1002_Profile")]), replies=10)
        assert out == b"$3\r\nold\r\n:1\r\n:-1\r\n+OK\r\n+OK\r\n:1\r\n:1\r\n+string\r\n+OK\r\n:1\r\n", out
        assert d.keys("*") == [b"user:1001:profile"]
        # What creates a bad name is still refused: a write, a rename or copy to it.
        for args in (("SET", "Bad_Key", "1"), ("RENAME", "user:1001:profile", "Bad_Key"),
                     ("COPY", "user:1001:profile", "Bad_Key"), ("INCR", "Bad_Key")):
            err = c.call(*args)
            assert isinstance(err, Exception) and "key 'Bad_Key' violates rule 'lowercase'" in str(err), (args, err)
        assert d.keys("*") == [b"user:1001:profile"]
        # Commands that bring in names the policy never sees are denied (#19 bypass 4).
        for args in (("REPLICAOF", "NO", "ONE"), ("SLAVEOF", "NO", "ONE"), ("DEBUG", "POPULATE", "3"),
                     ("MODULE", "LIST")):
            err = c.call(*args)
            assert isinstance(err, Exception) and "is not allowed here" in str(err), (args, err)
        # A leading hash tag is allowed as documented, and starts with its letter.
        assert c.call("SET", "{user:1001}:cart", "x") == "OK"
        assert kg.metric('keyguard_key_violations_total{rule="lowercase",action="observe",key_pattern="User_{id}_Profile"}') > 0
    finally:
        assert kg.stop() == 0


def test_refusals_name_every_rule_show_the_key_escaped_and_suggest_only_good_names(fresh):
    # #19 error texts: the first broken rule only, suggestions that break rules themselves
    # ("use user 1"), raw bytes of the key, and a 20 MiB key made a 40 MiB error line.
    kg = Keyguard(fresh.port, config=example("strict.yaml"))
    try:
        c = RespConn(kg.port)
        assert str(c.call("SET", "User 1", "x")) == \
            "ERR keyguard: key 'User 1' violates rules 'lowercase', 'charset', 'forbidden_characters'"
        assert str(c.call("SET", b"Bad\x00\r\n\xffKey", "x")) == \
            "ERR keyguard: key 'Bad\\x00\\x0d\\x0a\\xffKey' violates rules 'lowercase', 'charset', 'forbidden_characters'"
        long = "User:" + "x" * (20 << 20)
        err = str(c.call("SET", long, "x"))
        assert err == "ERR keyguard: key '%s... (%d bytes)' violates rules 'lowercase', 'max_length', " \
                      "'no_opaque_segments'" % (long[:64], len(long)), err[:300]
        assert str(c.call("SET", "User_1001_Profile", "x")) == \
            "ERR keyguard: key 'User_1001_Profile' violates rule 'lowercase': use user:1001:profile"
        assert fresh and direct(fresh).keys("*") == []
    finally:
        assert kg.stop() == 0


SET_ARGV = "return redis.call('SET', ARGV[1], 'x')"
LIBRARY = "#!lua name=kglib\nredis.register_function('setit', function(keys, args) return redis.call('SET', args[1], 'x') end)"


def test_strict_refuses_unreviewed_scripts_and_runs_reviewed_ones(fresh):
    # #19 bypass 3: scripts and functions write names keyguard never sees.
    import hashlib
    d = direct(fresh)
    sha = hashlib.sha1(SET_ARGV.encode()).hexdigest()
    d.function_load(LIBRARY)
    kg = Keyguard(fresh.port, config=example("strict.yaml"))
    try:
        c = RespConn(kg.port)
        why = " is not reviewed (key_policy.scripts): a script may write key names the key policy never sees"
        for args, what in [
                (("EVAL", SET_ARGV, "0", "Bad_Eval"), "script " + sha),
                (("EVALSHA", sha.upper(), "0", "Bad_Eval"), "script " + sha),
                (("SCRIPT", "LOAD", SET_ARGV), "script " + sha),
                (("FCALL", "setit", "0", "Bad_Fcall"), "function 'setit'"),
                (("FUNCTION", "LOAD", "REPLACE", LIBRARY), "script " + hashlib.sha1(LIBRARY.encode()).hexdigest()),
                (("FUNCTION", "RESTORE", "x"), "FUNCTION RESTORE (a dump cannot be reviewed)")]:
            assert str(c.call(*args)) == "ERR keyguard: " + what + why, args
        # Read-only variants pass (the server refuses writes from them).
        assert c.call("EVAL_RO", "return redis.call('GET', KEYS[1])", "1", "user:1:name") is None
        assert d.keys("*") == []
        assert kg.metric('keyguard_key_violations_total{rule="scripts",action="reject",key_pattern=""}') == 6
    finally:
        assert kg.stop() == 0
    reviewed = example("strict.yaml").replace("allowed_scripts: []", "allowed_scripts: [%s]" % sha).replace(
        "allowed_functions: []", "allowed_functions: [setit]")
    kg = Keyguard(fresh.port, config=reviewed)
    try:
        c = RespConn(kg.port)
        assert c.call("EVAL", SET_ARGV, "0", "user:1:name") == "OK"
        assert c.call("SCRIPT", "LOAD", SET_ARGV) == sha.encode()
        assert c.call("FCALL", "setit", "0", "user:2:name") == "OK"
        assert sorted(d.keys("*")) == [b"user:1:name", b"user:2:name"]
    finally:
        assert kg.stop() == 0


@pytest.mark.not_cluster(reason='ZUNIONSTORE user:5:profile over user:3:profile and user:4:profile: keys in different slots, CROSSSLOT as on a cluster node')
def test_rewrite_legacy_example_stores_the_new_names(fresh):
    kg = Keyguard(fresh.port, config=example("rewrite-legacy.yaml"))
    try:
        r = redis.Redis(port=kg.port)
        assert r.set("User_1001_Profile", "ada")
        assert r.get("User_1001_Profile") == b"ada"
        assert direct(fresh).keys("*") == [b"user:1001:profile"]
        # Every key of a multi-key command gets the same mapping.
        r.mset({"User_1_Profile": "a", "User_2_Profile": "b", "plain:key": "c"})
        assert sorted(direct(fresh).keys("*")) == [b"plain:key", b"user:1001:profile", b"user:1:profile",
                                                  b"user:2:profile"]
        r.zadd("User_3_Profile", {"m": 1})
        r.zadd("User_4_Profile", {"n": 2})
        assert r.zunionstore("User_5_Profile", ["User_3_Profile", "User_4_Profile"]) == 2
        assert direct(fresh).zrange("user:5:profile", 0, -1) == [b"m", b"n"]
        r.xadd("User_6_Profile", {"f": "v"}, id="1-1")
        # A reply that names the keys the command was given names them as the client did.
        assert r.xread({"User_6_Profile": "0"}) == [[b"User_6_Profile", [(b"1-1", {b"f": b"v"})]]]
        assert r.eval("return redis.call('GET', KEYS[1])", 1, "User_1_Profile") == b"a"
        assert r.delete("User_1_Profile", "User_2_Profile") == 2
        assert direct(fresh).exists("user:1:profile", "user:2:profile") == 0
        rewrites = kg.metric('keyguard_keys_rewritten_total{rule="legacy-profile"}')
        # set, get, mset (2), zadd, zadd, zunionstore (3), xadd, xread, eval, del (2)
        assert rewrites == 1 + 1 + 2 + 1 + 1 + 3 + 1 + 1 + 1 + 2, kg.metrics()
    finally:
        assert kg.stop() == 0


def test_warn_logs_a_json_line(fresh):
    kg = Keyguard(fresh.port, config="key_policy:\n  lowercase: {action: warn}\n")
    try:
        c = RespConn(kg.port)
        assert c.call("CLIENT", "SETNAME", "checkout") == "OK"
        assert c.call("SET", "Cart:7", "1") == "OK"
        def warn_lines():
            return [line for line in kg.log_lines() if line["level"] == "warn"]
        lines = wait_until(warn_lines, "the warn line")
        assert len(lines) == 1, kg.output()
        line = lines[0]
        client = line.pop("client")
        assert client.startswith("127.0.0.1:")
        assert line == {"level": "warn", "event": "key_violation", "rule": "lowercase", "key": "Cart:7",
                        "command": "set", "suggestion": "cart:7", "client_name": "checkout"}
        assert direct(fresh).get("Cart:7") == b"1"  # warn changes nothing
    finally:
        assert kg.stop() == 0


def test_default_policy_only_observes(fresh):
    kg = Keyguard(fresh.port)
    try:
        r = redis.Redis(port=kg.port)
        r.set("Bad Key:1", "v")
        r.set("user:1:name", "ada")
        assert sorted(direct(fresh).keys("*")) == [b"Bad Key:1", b"user:1:name"]
        text = kg.metrics()
        violations = sorted(line for line in text.splitlines() if line.startswith("keyguard_key_violations_total{"))
        assert violations == [
            'keyguard_key_violations_total{rule="charset",action="observe",key_pattern="Bad Key:{id}"} 1',
            'keyguard_key_violations_total{rule="forbidden_characters",action="observe",key_pattern="Bad Key:{id}"} 1',
            'keyguard_key_violations_total{rule="lowercase",action="observe",key_pattern="Bad Key:{id}"} 1',
        ]
    finally:
        assert kg.stop() == 0


def test_check_config_names_the_field():
    bad = os.path.join(ROOT, "build", "bad-policy.yaml")
    with open(bad, "w") as f:
        f.write("key_policy:\n  rules:\n    - name: x\n      pattern: '(unclosed'\n")
    out = subprocess.run([KEYGUARD, "check-config", bad], capture_output=True, text=True)
    os.unlink(bad)
    assert out.returncode == 2
    assert out.stderr == "keyguard: %s: key_policy.rules[0].pattern: missing ): (unclosed\n" % bad
    for name in ("observe.yaml", "strict.yaml", "rewrite-legacy.yaml"):
        out = subprocess.run([KEYGUARD, "check-config", os.path.join(ROOT, "examples", name)], capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stderr


def test_unknown_commands_rejected_and_policy_off(fresh):
    kg = Keyguard(fresh.port, config="unknown_commands: reject_unknown\nkey_policy: {enabled: false}\n")
    try:
        c = RespConn(kg.port)
        assert c.exchange(encode("NOSUCHCMD", "x") + encode("SET", "Bad Key", "1"), replies=2) == \
            b"-ERR keyguard: unknown command 'NOSUCHCMD'\r\n+OK\r\n"
        assert kg.metric('keyguard_commands_rejected_total{reason="unknown_command"}') == 1
        assert "keyguard_key_violations_total{" not in kg.metrics()
    finally:
        assert kg.stop() == 0
