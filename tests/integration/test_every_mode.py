"""The same proofs in every upstream mode: dedicated connections, shared connections, and a Redis
Cluster (three primaries). Each test runs once per mode (the `mode` fixture starts its own servers
and keyguard, with the tenants of examples/tenants.yaml), so this file is not run again by the
shared and cluster passes of scripts/test.sh.

What is proved here is a rule, with a generator rather than a list:
- every reply keyguard makes itself keeps CLIENT REPLY OFF/SKIP as the server counts them (a skip
  a locally answered command took is spent on the server too), so no reply ever answers another
  command;
- keyguard frames an inline command as the server does (processInlineBuffer, sdssplitargs,
  PROTO_INLINE_MAX_SIZE), and nothing but multibulk goes upstream, so one client's inline line
  cannot freeze or close a connection other clients' commands share;
- a command that blocks on the server is never sent on a shared connection: XREAD and XREADGROUP
  options are read as the server reads them (in any order), checked against the server itself.
"""
import contextlib
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import threading
import time

import pytest
import redis

from cluster import cluster, seed_url
from conftest import ROOT, Keyguard, Redis, blocked_clients, wait_until
from resp import EXTRA_WINDOW, PATIENCE, Closed, RespConn, encode

MODES = ["dedicated", "shared", "cluster"]
CONFIG = open(os.path.join(ROOT, "examples", "tenants.yaml")).read() + "deny_commands: [FLUSHALL]\n"


class Mode:
    """One mode's servers and keyguard: `kg`, and `direct_ports` (every primary, for direct runs
    and checks)."""

    def __init__(self, name):
        self.name = name
        self._stack = contextlib.ExitStack()
        if name == "cluster":
            c = self._stack.enter_context(cluster(primaries=3, replicas=0))
            self.direct_ports = [p for p in c.ports if c.role(p) == "master"]
            self.kg = Keyguard(0, config=CONFIG, upstream=seed_url(c), threads=1)
        else:
            r = Redis("--notify-keyspace-events", "KEA")
            self._stack.callback(r.stop)
            self.direct_ports = [r.port]
            # One worker thread: every client of keyguard shares its shared connections.
            self.kg = Keyguard(r.port, config=CONFIG, threads=1, extra=("--upstream-connections", name))

    def close(self):
        status = self.kg.stop()
        self._stack.close()
        assert status == 0, self.kg.output()[-3000:]

    def flush(self):
        for p in self.direct_ports:
            redis.Redis(port=p).flushall()

    def tenant(self, user="alice"):
        c = RespConn(self.kg.port)
        assert c.call("AUTH", user, user + "-secret") == "OK"
        return c

    def direct_for(self, stored_key):
        """A direct connection to the primary holding `stored_key`."""
        port = self.direct_ports[0]
        if self.name == "cluster":
            d = redis.Redis(port=port)
            slot = d.execute_command("CLUSTER", "KEYSLOT", stored_key)
            port = next(r[2][1] for r in d.execute_command("CLUSTER", "SLOTS") if r[0] <= slot <= r[1])
        return RespConn(port)


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    m = Mode(request.param)
    yield m
    m.close()


def normal(v):
    """A reply as comparable text: bytes and simple strings alike, errors as ('error', ...)."""
    if isinstance(v, Exception):
        return ("error",)
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list):
        return [normal(e) for e in v]
    return v


def read_until(c, token):
    """Every reply up to and including the bulk `token`."""
    out = []
    while True:
        v = c.value()
        out.append(normal(v))
        if v == token.encode():
            return out


# -------------------------------------------------------------------------------------------------
# One path for keyguard's own replies: CLIENT REPLY OFF/SKIP kept

def test_a_skip_taken_by_a_command_keyguard_answers_is_spent_on_the_server(mode):
    """Cluster: keyguard answers READONLY and READWRITE itself. Under CLIENT REPLY SKIP the server
    still owed the skip, and spent it on the next command: every later reply answered the command
    before it (a tenant's PING got the node's whole unfiltered INFO)."""
    c = mode.tenant()
    for cmd in ("READONLY", "READWRITE"):
        c.send("CLIENT", "REPLY", "SKIP")
        c.send(cmd)
        c.send("PING")
        c.send("INFO", "everything")
        assert c.value() == "PONG"
        info = c.value()
        assert isinstance(info, bytes) and info.startswith(b"# Server"), info[:200]
        assert b"cmdstat_" not in info and b"db0:" not in info and b"connected_clients" not in info, info
        assert c.call("ECHO", "after") == b"after"


def pool(mode, key):
    """(keyguard's command, the direct server's): the same command, or for one keyguard answers
    itself a stand-in whose reply the server makes the same (an error for a refusal: errors compare
    equal whatever their text; +OK for AUTH). `key`: the tenant's key, stored as tenant:a:`key`."""
    stored = "tenant:a:" + key
    p = [
        (("ECHO", None), ("ECHO", None)),
        (("PING",), ("PING",)),
        (("CLIENT", "REPLY", "SKIP"), ("CLIENT", "REPLY", "SKIP")),
        (("CLIENT", "REPLY", "OFF"), ("CLIENT", "REPLY", "OFF")),
        (("CLIENT", "REPLY", "ON"), ("CLIENT", "REPLY", "ON")),
        (("CLIENT", "SETNAME", "n1"), ("CLIENT", "SETNAME", "n1")),
        # Tenancy: AUTH is answered by keyguard (Login), an unlisted script and a denied command
        # refused (Refuse).
        (("AUTH", "alice", "alice-secret"), ("SELECT", "0")),
        (("EVAL", "return 1", "0"), ("EVAL", "return redis.error_reply('x')", "0")),
        (("FLUSHALL",), ("EVAL", "return redis.error_reply('x')", "0")),
        (("SET", key, "v"), ("SET", stored, "v")),
        (("GET", key), ("GET", stored)),
    ]
    if mode.name == "cluster":
        # Answered by keyguard with a cluster upstream (the one-node view); a node answers the
        # same words.
        p += [
            (("READONLY",), ("READONLY",)),
            (("READWRITE",), ("READWRITE",)),
            (("CLUSTER", "KEYSLOT", "k"), ("CLUSTER", "KEYSLOT", "k")),
        ]
    return p


def pinned_key(mode):
    """A key of alice's that a connection of her own reaches: with a cluster, a connection pinned
    (CLIENT REPLY pins) reaches one node, and keys of the others are refused there."""
    if mode.name != "cluster":
        return "k"
    c = mode.tenant()
    assert c.call("CLIENT", "REPLY", "ON") == "OK"
    key = next(k for k in ("k%d" % i for i in range(100)) if c.call("SET", k, "x") == "OK")
    c.close()
    return key


def run(conn, commands, end):
    for args in commands:
        conn.send(*args)
    conn.send("CLIENT", "REPLY", "ON")
    conn.send("ECHO", end)
    return read_until(conn, end)


@pytest.mark.parametrize("seed", range(6))
def test_reply_modes_hold_across_keyguards_own_replies_generated(mode, seed):
    """Random pipelines of CLIENT REPLY ON/OFF/SKIP among commands keyguard answers itself and
    commands it forwards: the replies the client gets are exactly those a direct connection gets
    for the same pipeline (keyguard's own answers standing in for the server's), in order."""
    rng = random.Random(seed * 7919 + MODES.index(mode.name))
    key = pinned_key(mode)
    choices = pool(mode, key)
    mode.flush()
    direct = mode.direct_for("tenant:a:" + key)  # (the direct run's one key: alice's, as stored)
    for round_ in range(8):
        kg_cmds, direct_cmds = [], []
        for i in range(rng.randint(5, 30)):
            kc, dc = rng.choice(choices)
            if kc[0] == "ECHO":
                token = "t%d-%d-%d" % (seed, round_, i)
                kc, dc = ("ECHO", token), ("ECHO", token)
            kg_cmds.append(kc)
            direct_cmds.append(dc)
        c = mode.tenant()
        end = "end-%d-%d" % (seed, round_)
        mode.flush()
        got = run(c, kg_cmds, end)
        mode.flush()  # (the same server: each run starts from no keys)
        want = run(direct, direct_cmds, end)
        c.close()
        assert got == want, "\n%r\n%r\n%r" % (kg_cmds, got, want)
    direct.close()


# -------------------------------------------------------------------------------------------------
# Inline commands: framed as the server frames them, and re-encoded on their way upstream

def random_inline_args(rng):
    """The arguments part of an inline line, from the pieces sdssplitargs treats specially:
    quotes of both kinds with their escapes, blanks of every kind, a quote closed against a word
    (an error), an unclosed quote (an error), CR inside the line."""
    pieces = []
    for _ in range(rng.randint(0, 6)):
        r = rng.random()
        if r < 0.3:
            pieces.append("".join(rng.choice("abcXYZ019:{}*?-_") for _ in range(rng.randint(1, 8))))
        elif r < 0.5:
            body = "".join(rng.choice(["a", " ", "\\n", "\\x41", "\\x4", "\\\"", "\\\\", "'", "\\t", "z"])
                           for _ in range(rng.randint(0, 6)))
            pieces.append('"%s"' % body)
        elif r < 0.65:
            body = "".join(rng.choice(["a", " ", "\\'", "\\n", '"', "b"]) for _ in range(rng.randint(0, 5)))
            pieces.append("'%s'" % body)
        elif r < 0.8:
            pieces.append(rng.choice([" ", "\t", "  ", "\v", "\f", "\r"]))
        elif r < 0.9:
            pieces.append(rng.choice(['"a"b', "'a'b", '"open', "'open", '""', "''"]))
        else:
            pieces.append(rng.choice(["\\", "x\\y", "\"", "a'b", 'a"b']))
        pieces.append(rng.choice([" ", " ", "\t", ""]))
    return "".join(pieces)


def inline_exchange(conn, line):
    """Sends one inline line and returns its reply's exact bytes (b"<closed>": none came)."""
    try:
        conn.send_raw(line)
        return conn.read()[1]
    except (Closed, OSError):
        return b"<closed>"


@pytest.mark.parametrize("seed", range(3))
def test_inline_commands_are_framed_as_the_server_frames_them_generated(mode, seed):
    """Random inline lines (RPUSH of whatever sdssplitargs makes of them) through keyguard and
    directly: the same reply (the count, the arity error, or the protocol error and the close), and
    the same list stored."""
    rng = random.Random(seed * 104729 + MODES.index(mode.name))
    mode.flush()
    stored = "direct:{l}"  # (the hash tag: the same slot as the tenant's tenant:a:{l})
    kg, direct = mode.tenant(), mode.direct_for(stored)
    for i in range(150):
        tail = random_inline_args(rng).encode()
        got = inline_exchange(kg, b"RPUSH {l} " + tail + b"\r\n")
        want = inline_exchange(direct, b"RPUSH " + stored.encode() + b" " + tail + b"\r\n")
        assert got == want, (tail, got, want)
        if got == b"<closed>" or got.startswith(b"-ERR Protocol error"):  # (then both closed)
            kg, direct = mode.tenant(), mode.direct_for(stored)
            continue
        listed = kg.call("LRANGE", "{l}", "0", "-1")
        assert listed == direct.call("LRANGE", stored, "0", "-1"), tail
        assert kg.call("DEL", "{l}") == direct.call("DEL", stored)
    kg.close()
    direct.close()


def neighbour_pings(mode, n, out, timeout=PATIENCE):
    """Another tenant's `n` pipelined PINGs, answered (the replies in `out`) within `timeout`."""
    b = RespConn(mode.kg.port, timeout=timeout)
    assert b.call("AUTH", "bob", "bob-secret") == "OK"
    b.send_raw(b"*1\r\n$4\r\nPING\r\n" * n)
    out.extend(b.value() for _ in range(n))
    b.close()


def test_an_inline_line_with_a_nul_holds_only_its_own_connection(mode):
    """`PING a<NUL>b`: the server's strchr never finds its end, so a connection that carried its
    bytes ran nothing more (a shared one froze for every client on it). keyguard frames it as the
    server does: that client alone waits, as it would directly, and gets the server's protocol
    error once past the inline limit; its neighbours are answered throughout."""
    for port in (None, mode.direct_ports[0]):
        c = mode.tenant() if port is None else RespConn(port)
        c.send_raw(b"PING a\x00b\r\nPING\r\n")
        if port is None:
            replies = []
            neighbour_pings(mode, 20, replies)
            assert replies == ["PONG"] * 20
        assert c.quiet() == b"", "nothing runs after the line (as directly: port %s)" % port
        c.send_raw(b"x" * 70000)
        out = c.read_until_closed()
        assert out == b"-ERR Protocol error: too big inline request\r\n", (port, out[:200])


def test_a_long_inline_line_reaches_no_shared_connection(mode):
    """An inline line past PROTO_INLINE_MAX_SIZE (64 KB) is keyguard's protocol error to that
    client alone (the server closed a shared connection for it, failing every client's commands
    in flight there); one within it is re-encoded and served."""
    c = mode.tenant()
    assert c.call("PING") == "PONG"
    big = b"x" * (64 * 1024 - 6)  # (the line with its CR: the limit)
    c.send_raw(b"ECHO " + big + b"\r\n")
    assert c.value() == big
    replies = []
    t = threading.Thread(target=neighbour_pings, args=(mode, 200, replies))
    c.send_raw(b"ECHO " + b"y" * 100000 + b"\r\n")
    t.start()
    out = c.read_until_closed()
    t.join(PATIENCE)
    assert out == b"-ERR Protocol error: too big inline request\r\n"
    assert replies == ["PONG"] * 200


# -------------------------------------------------------------------------------------------------
# Blocking commands: decided as the server decides, never on a shared connection

def random_xread(rng, group, key, last_id):
    """XREAD or XREADGROUP with options drawn in any order, mostly valid, sometimes not (a value
    that is a keyword, a NUL-ended option word, GROUP in XREAD, a missing STREAMS)."""
    options = []
    valid = True
    if rng.random() < 0.7:
        options.append([rng.choice(["BLOCK", "block", "BLOCK\x00x"]), "0"])
    if group and rng.random() < 0.85:
        options.append(["GROUP", rng.choice(["g", "g", "streams"]), rng.choice(["c", "block", "STREAMS"])])
    for _ in range(rng.randint(0, 3)):
        r = rng.random()
        if r < 0.2:
            options.append(["BLOCK", "0"])
        elif r < 0.5:
            v = rng.choice(["1", "5", "1", "streams", "x"])
            valid &= v in ("1", "5")
            options.append(["COUNT", v])
        elif r < 0.7:
            options.append(["NOACK"])
            valid &= group
        elif r < 0.85:
            options.append(["GROUP", rng.choice(["g", "streams"]), rng.choice(["c", "block", "STREAMS"])])
            valid &= group
        else:
            options.append([rng.choice(["JUNK", "BLOCK"])])  # (a last BLOCK with no value is a syntax error too)
            valid = False
    rng.shuffle(options)
    args = ["XREADGROUP" if group else "XREAD"] + [a for o in options for a in o]
    if rng.random() < 0.9:
        args += ["STREAMS", key, last_id]
    else:
        valid = False
    return args, valid


def server_blocks(port, conn, args):
    """Whether `args` sent on `conn` blocks on the server at `port` (its blocked_clients goes up)
    rather than being answered; a blocked one is released by closing `conn`."""
    before = blocked_clients(port)
    conn.send(*args)
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        if conn.buf or select.select([conn.sock], [], [], 0.005)[0]:
            conn.value()
            return False
        if blocked_clients(port) > before:
            return True
    raise AssertionError("neither answered nor blocked: %r" % (args,))


PINS = 'keyguard_upstream_pins_total{reason="blocking"}'


@pytest.mark.parametrize("options", [
    ["COUNT", "1", "BLOCK", "0", "GROUP", "g", "c"],
    ["NOACK", "BLOCK", "0", "GROUP", "g", "c"],
    ["GROUP", "g", "c", "GROUP", "g", "c2", "BLOCK", "0"],
    ["GROUP", "g", "STREAMS", "BLOCK", "0"],
], ids=["block-before-group", "block-after-noack", "second-group", "consumer-named-streams"])
def test_xreadgroup_blocks_only_its_own_client_whatever_the_option_order(mode, options):
    """The orders a review found: each blocked the shared connection of every client of the worker
    (or node), for as long as it blocked, also after its client hung up."""
    mode.flush()
    ctl = mode.direct_for("tenant:a:{s}")
    port = ctl.sock.getpeername()[1]
    assert ctl.call("XGROUP", "CREATE", "tenant:a:{s}", "g", "$", "MKSTREAM") == "OK"
    alice = mode.tenant()
    alice.send("XREADGROUP", *options, "STREAMS", "{s}", ">")
    wait_until(lambda: blocked_clients(port) == 1, "alice's read blocked on the server")
    replies = []
    neighbour_pings(mode, 5, replies, timeout=10)
    assert replies == ["PONG"] * 5
    assert ctl.call("XADD", "tenant:a:{s}", "1-1", "f", "v") == b"1-1"
    assert alice.value() == [[b"{s}", [[b"1-1", [b"f", b"v"]]]]]
    alice.close()
    ctl.close()


@pytest.mark.parametrize("seed", range(2))
def test_blocking_reads_never_hold_a_shared_connection_generated(mode, seed):
    """XREAD/XREADGROUP with random option orders, against the server itself: every one that
    blocks the server blocks only its own client through keyguard (pinned first: another tenant
    on the same worker is answered meanwhile), and keyguard pins exactly those (the valid ones)."""
    rng = random.Random(seed * 15485863 + MODES.index(mode.name))
    mode.flush()
    key, stored = "{s}", "direct:{s}"
    ctl = mode.direct_for(stored)
    port = ctl.sock.getpeername()[1]
    for k in (stored, "tenant:a:{s}"):
        for g in ("g", "streams"):
            assert ctl.call("XGROUP", "CREATE", k, g, "$", "MKSTREAM") == "OK"
    seen = {True: 0, False: 0}
    for _ in range(40):
        group = rng.random() < 0.6
        args, valid = random_xread(rng, group, key, ">" if group else "$")
        direct = mode.direct_for(stored)
        blocks = server_blocks(port, direct, [a if a != key else stored for a in args])
        direct.close()
        wait_until(lambda: blocked_clients(port) == 0, "the direct client released")
        seen[blocks] += 1
        pins = mode.kg.metric(PINS)
        alice = mode.tenant()
        alice.send(*args)
        replies = []
        neighbour_pings(mode, 1, replies, timeout=10)
        assert replies == ["PONG"], args
        if blocks:
            got = []
            wait_until(lambda: blocked_clients(port) == 1 or got.append(alice.quiet(0.001)) or any(got),
                       "alice's read blocked on the server")
            assert not any(got), "%r %r" % (args, got)
        else:
            alice.value()
        if mode.name != "dedicated":
            pinned = mode.kg.metric(PINS) - pins
            assert pinned == (1 if blocks else 0) or (pinned == 1 and not valid), (args, blocks, pinned)
        alice.close()
        wait_until(lambda: blocked_clients(port) == 0, "alice's read released")
    assert seen[True] >= 5 and seen[False] >= 5, seen
    ctl.close()


# -------------------------------------------------------------------------------------------------
# What a well-behaved client gets

def test_a_tenants_resp3_info_is_a_whole_verbatim_string(mode):
    """INFO's reply is RESP3 verbatim text ("txt:" first); the tenant filter took "txt:# Server"
    for no section and sent `=0` with no format, which hiredis and redis-cli -3 drop the
    connection for."""
    c = RespConn(mode.kg.port)
    assert c.call("HELLO", "3", "AUTH", "alice", "alice-secret")[b"proto"] == 3
    c.send("INFO", "everything")
    _, raw = c.read()
    header, _, body = raw.partition(b"\r\n")
    assert header[:1] == b"=" and int(header[1:]) == len(body) - 2, raw[:100]
    assert body.startswith(b"txt:# Server\r\nredis_version:"), body[:100]
    assert b"# Keyspace" not in body and b"cmdstat_" not in body and b"# Clients" not in body
    out = subprocess.run(["redis-cli", "-3", "-p", str(mode.kg.port), "--user", "alice", "--pass", "alice-secret",
                          "--no-auth-warning", "INFO", "server"], capture_output=True, text=True, timeout=PATIENCE)
    text = out.stdout.replace("\r\n", "\n")
    assert out.returncode == 0 and text.startswith("# Server\nredis_version:"), (out.stdout[:200], out.stderr)


@pytest.mark.parametrize("command", ["DBSIZE", "RANDOMKEY", "FLUSHDB"])
def test_a_subscribed_tenants_walk_command_gets_the_servers_error(mode, command):
    """keyguard answers a tenant's DBSIZE, RANDOMKEY and FLUSH* by walking its keys with a script;
    on a RESP2 subscribed connection the server's error named 'eval' rather than the command."""
    direct = RespConn(mode.direct_ports[0])
    c = mode.tenant()
    for conn in (direct, c):
        conn.send("SUBSCRIBE", "ch")
        assert conn.value() == [b"subscribe", b"ch", 1]
    want = str(direct.call(command))
    assert want.startswith("ERR Can't execute '%s'" % command.lower()), want
    assert str(c.call(command)) == want
    direct.close()
    c.close()


def test_a_cluster_aware_client_connects_as_a_tenant(mode):
    """redis-py's RedisCluster (it asks CLUSTER SLOTS, COMMAND, ...) through keyguard in front of a
    three-primary cluster, logged in as a tenant: it sees one node, keyguard, and each tenant only
    its own keys, stored with its prefix on the primaries that own them."""
    if mode.name != "cluster":
        pytest.skip("a Redis Cluster upstream only")
    from redis.cluster import RedisCluster
    mode.flush()
    alice = RedisCluster(host="127.0.0.1", port=mode.kg.port, username="alice", password="alice-secret",
                         decode_responses=True)
    bob = RedisCluster(host="127.0.0.1", port=mode.kg.port, username="bob", password="bob-secret",
                       decode_responses=True)
    try:
        assert [(n.host, n.port) for n in alice.get_nodes()] == [("127.0.0.1", mode.kg.port)]
        expected = {"rc:%d" % i: "v%d" % i for i in range(60)}
        for k, v in expected.items():
            assert alice.set(k, v) is True
        assert alice.mget_nonatomic(list(expected)) == list(expected.values())
        assert alice.execute_command("MGET", "{t}a", "{t}b") == [None, None]
        assert alice.dbsize() == 60 and bob.dbsize() == 0
        assert sorted(alice.keys("*")) == sorted(expected) and bob.keys("*") == []
        assert bob.get("rc:1") is None and bob.set("rc:1", "b") is True and alice.get("rc:1") == "v1"
        stored = {}
        for p in mode.direct_ports:
            d = redis.Redis(port=p, decode_responses=True)
            for k in d.keys("*"):
                assert d.execute_command("CLUSTER", "KEYSLOT", k) in range(16384)
                stored[k] = d.get(k)
        assert stored == {**{"tenant:a:" + k: v for k, v in expected.items()}, "tenant:b:rc:1": "b"}
        assert len({p for p in mode.direct_ports
                    if redis.Redis(port=p).dbsize() > 0}) == 3, "the keys are spread over every primary"
    finally:
        alice.close()
        bob.close()


def test_ioredis_cluster_client_connects_as_a_tenant(mode):
    """ioredis's Cluster client (Node.js: CLUSTER SLOTS, its own slot routing, pipelines sent to
    one node, MULTI) through keyguard in front of a three-primary cluster, as two tenants: it sees
    one node, keyguard; each tenant's keys are its own, stored with its prefix on every primary."""
    if mode.name != "cluster":
        pytest.skip("a Redis Cluster upstream only")
    script = os.path.join(ROOT, "tests", "integration", "node", "cluster_tenant.js")
    mode.flush()

    def run(user):
        out = subprocess.run(["node", script, str(mode.kg.port), user, user + "-secret"], capture_output=True,
                             text=True, timeout=PATIENCE)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    alice = run("alice")
    keys = ["io:%d" % i for i in range(40)]
    assert alice == {
        "nodes": ["127.0.0.1:%d" % mode.kg.port],
        "sets": ["OK"] * 40,
        "gets": ["v-" + k for k in keys],
        "pipeline": [[None, "OK"], [None, 1], [None, "1"]],
        "mget": ["1", None],
        "hash": [2, {"f": "1", "g": "2"}],
        "multi": [[None, 2], [None, "2"]],
        "dbsize": 43,
    }, alice
    bob = run("bob")
    assert bob["gets"] == ["v-" + k for k in keys] and bob["dbsize"] == 43 and "error" not in bob, bob
    stored = set()
    for p in mode.direct_ports:
        stored |= {k.decode() for k in redis.Redis(port=p).keys("*")}
    names = keys + ["{io}a", "{io}n", "io:h"]
    assert stored == {"tenant:a:" + k for k in names} | {"tenant:b:" + k for k in names}
    assert len({p for p in mode.direct_ports if redis.Redis(port=p).dbsize() > 0}) == 3


@pytest.mark.parametrize("cmd", [("BLPOP", "a", "str", "0.01"), ("BLMOVE", "a", "str", "LEFT", "RIGHT", "0.01"),
                                 ("BZPOPMIN", "x", "y", "z", "0.01")])
def test_a_tenants_blocking_command_over_several_slots_is_answered(mode, cmd):
    """Cluster: a blocking command pins to its keys' node; a tenant's fresh pin sends keyguard's
    CLIENT ID first, and the command, whose stored keys are in several slots, waited for that pin
    to end, then pinned again: 24,000 pins in 5 s, never answered (found by the tenant fuzzer in
    the cluster pass). It gets CROSSSLOT, as a cluster node's client; in the other modes the
    server's answer (nothing to pop: nil after the timeout)."""
    c = mode.tenant()
    reply = c.call(*cmd)
    if mode.name == "cluster":
        assert str(reply) == "CROSSSLOT Keys in request don't hash to the same slot", reply
    else:
        assert reply is None, reply
    assert c.call("PING") == "PONG"
    c.close()


def test_a_shared_connection_that_owes_a_reply_for_too_long_is_closed():
    """The backstop: whatever holds a shared connection's reply (a command keyguard could not tell
    blocks, a paused server) holds it for shared_reply_timeout_ms at most; then the connection is
    closed, its commands in flight get an error, and it is made again. A command answered within
    the bound is not touched."""
    r = Redis()
    kg = Keyguard(r.port, config="upstream_connections: shared\nshared_reply_timeout_ms: 1500\n", threads=1)
    try:
        c = RespConn(kg.port)
        assert c.call("DEBUG", "SLEEP", "0.5") == "OK"  # (slow, within the bound)
        assert kg.metric('keyguard_upstream_errors_total{reason="timeout"}') == 0
        os.kill(r.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            c.send("SET", "k", "v")
            reply = c.value()
            waited = time.monotonic() - started
        finally:
            os.kill(r.proc.pid, signal.SIGCONT)
        assert str(reply) == "ERR keyguard: upstream unavailable", reply
        assert 1.4 <= waited < 10, waited
        assert kg.metric('keyguard_upstream_errors_total{reason="timeout"}') == 1
        [event] = kg.events("shared_upstream_reply_timeout")
        assert event["commands_in_flight"] == 1 and event["waited_ms"] >= 1500, event
        wait_until(lambda: c.call("PING") == "PONG", "the shared connection made again")
        assert c.call("GET", "k") in (None, b"v")  # (the server may have read the SET before it stopped)
        c.close()
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
        r.stop()


def test_asking_leaves_a_cluster_client_free_to_reach_every_node(mode):
    """ASKING pinned a cluster client to one node's connection for good: its later multi-slot
    MGET and DEL got CROSSSLOT. keyguard follows every ASK itself, so ASKING is answered +OK."""
    if mode.name != "cluster":
        pytest.skip("a Redis Cluster upstream only")
    mode.flush()
    c = mode.tenant()
    pins = mode.kg.metric('keyguard_upstream_pins_total{reason="client"}')
    assert c.call("ASKING") == "OK"
    keys = ["a%d" % i for i in range(12)]  # (over every primary)
    assert c.call("MSET", *[x for k in keys for x in (k, "v")]) == "OK"
    assert c.call("MGET", *keys) == [b"v"] * 12
    assert c.call("DEL", *keys) == 12
    assert mode.kg.metric('keyguard_upstream_pins_total{reason="client"}') == pins
    # In a transaction (pipelined, in one write: its node is the first keyed command's among those
    # read with the MULTI; sent one by one, the SET could come after the pin to any node) the
    # transaction's node queues it, as the server does.
    c.send_raw(b"".join(encode(*args) for args in (("MULTI",), ("ASKING",), ("SET", "a1", "x"), ("EXEC",))))
    assert [c.value() for _ in range(4)] == ["OK", "QUEUED", "QUEUED", ["OK", "OK"]]
    c.close()


@pytest.mark.parametrize("how", ["dedicated", "shared"])
def test_a_server_close_after_its_reply_reaches_the_client_with_the_reply(how):
    """When the server replies and then closes (CLIENT KILL of its own connection, alone or in a
    transaction), the end of the stream comes with the reply's bytes and raises no event of its
    own: the client got the reply and then waited, connected, until its next command (8 to 16 tries
    of 20 here). Now it gets the reply and the close together, as direct; in shared mode the
    command pinned the client, so it is that connection that closes. A client killed while idle by
    another sees the close too."""
    r = Redis()
    kg = Keyguard(r.port, threads=1, extra=("--upstream-connections", how))
    kill = encode("CLIENT", "KILL", "SKIPME", "no")
    try:
        for i in range(20):
            c = RespConn(kg.port)
            assert c.call("PING") == "PONG"
            if i % 2:
                got = c.exchange(encode("MULTI") + kill + encode("EXEC"), closed=True, timeout=5)
                assert re.fullmatch(rb"\+OK\r\n\+QUEUED\r\n\*1\r\n:\d+\r\n<closed>", got), (i, got)
            else:
                # (a command pipelined after it never runs: direct, the close is all the client sees)
                got = c.exchange(kill + (encode("GET", "k") if i % 4 == 0 else b""), closed=True, timeout=5)
                assert re.fullmatch(rb":\d+\r\n<closed>", got), (i, got)
            c.close()
        if how == "dedicated":
            idle, killer = RespConn(kg.port), RespConn(kg.port)
            assert idle.call("PING") == "PONG"
            assert killer.call("CLIENT", "KILL", "SKIPME", "yes") >= 1
            assert idle.read_until_closed(timeout=5) == b""
            assert killer.call("PING") == "PONG"
        assert kg.metric('keyguard_commands_total{command="client",outcome="failed"}') == 0
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
        r.stop()


SPIN_LIBRARY = "#!lua name=kgspin\nredis.register_function('spin', function() while true do end end)"


@pytest.mark.parametrize("how", ["dedicated", "shared"])
@pytest.mark.parametrize("kill", ["SCRIPT", "FUNCTION"])
def test_a_runaway_script_can_be_killed_from_another_client(how, kill):
    """A script that never ends holds the connection it runs on; with shared connections that was
    every client's of the worker, their SCRIPT KILL and FUNCTION KILL included, which waited behind
    it for ever (with one worker thread no client of keyguard could kill it). A kill goes on a
    connection of the client's own, which the server reads while the script runs, and the client
    comes back to the shared connection with the reply."""
    r = Redis("--busy-reply-threshold", "100")
    kg = Keyguard(r.port, threads=1, extra=("--upstream-connections", how))
    try:
        setup = RespConn(kg.port)
        if kill == "FUNCTION":
            assert setup.call("FUNCTION", "LOAD", SPIN_LIBRARY) == b"kgspin"
        runner, neighbour, killer = RespConn(kg.port), RespConn(kg.port), RespConn(kg.port)
        assert killer.call("PING") == "PONG" and neighbour.call("PING") == "PONG"
        if kill == "FUNCTION":
            runner.send("FCALL", "spin", "0")
        else:
            runner.send("EVAL", "while true do end", "0")
        direct = RespConn(r.port)
        wait_until(lambda: "BUSY" in str(direct.call("PING")), "the script running past the threshold")
        neighbour.send("GET", "k")
        killer.sock.settimeout(10)
        assert killer.call(kill, "KILL") == "OK"
        killed = runner.value()
        assert isinstance(killed, Exception) and "killed by user" in str(killed), killed
        # The neighbour's GET gets the server's BUSY, as direct: with shared connections a script
        # is on the write lane's, and a read on the read lane's (a write sent behind the script on
        # the write lane's waits for it: docs/configuration.md).
        late = neighbour.value()
        assert isinstance(late, Exception) and str(late).startswith("BUSY "), late
        assert killer.call("SET", "k", "v") == "OK" and neighbour.call("GET", "k") == b"v"
        if how == "shared":
            assert kg.metric('keyguard_upstream_pins_total{reason="control"}') == 1
            # (back on the shared connection: its own went to the idle pool)
            assert kg.metric('keyguard_upstream_connections_by_kind{kind="pinned"}') == 0
        for c in (setup, runner, neighbour, killer, direct):
            c.close()
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
        r.stop()


@pytest.mark.parametrize("how", ["SUBSCRIBE", "PSUBSCRIBE"])
def test_keyspace_notifications_are_heard_from_every_node_or_refused(mode, how):
    """Each primary notifies of its own keys only, and a subscription is on one node: through a
    cluster a keyspace subscription heard 1 event of 6 writes on 3 nodes, silently. It is refused
    there, with no pin made (the client's keys on every node stay reachable), and heard whole in
    the other modes."""
    channel = "__keyspace@0__:*" if how == "PSUBSCRIBE" else "__keyevent@0__:set"
    sub = mode.tenant()
    keys = ["ks:%d" % i for i in range(6)]
    if mode.name == "cluster":
        reply = sub.call(how, channel)
        assert str(reply).startswith("ERR keyguard: keyspace notifications are not served through a Redis Cluster"), reply
        # A pattern that names them otherwise, and a mix with an ordinary channel, are refused too;
        # a pattern from a wildcard on is not (it hears what it hears from one node: documented).
        if how == "PSUBSCRIBE":
            assert isinstance(sub.call(how, "news", "__key*"), Exception)
        assert isinstance(sub.call(how, "news", "__keyevent@0__:del"), Exception)
        assert sub.call("MSET", *[x for k in keys for x in (k, "v")]) == "OK"  # every node: not pinned
        assert sub.call("MGET", *keys) == [b"v"] * 6
        return
    writer = mode.tenant()
    assert isinstance(sub.call(how, channel), list)
    for k in keys:
        assert writer.call("SET", k, "v") == "OK"
    heard = [sub.value() for _ in keys]
    if how == "PSUBSCRIBE":
        assert [(m[0], m[2], m[3]) for m in heard] == [(b"pmessage", b"__keyspace@0__:" + k.encode(), b"set")
                                                       for k in keys], heard
    else:
        assert [(m[0], m[2]) for m in heard] == [(b"message", k.encode()) for k in keys], heard
    sub.close()
    writer.close()


# Under CLIENT PAUSE WRITE: served (reads; an unknown command, a write of the wrong arity: refused
# before the pause check) and held (writes, scripts, PUBLISH, a container's write subcommand).
SERVED = [("GET", "p:1"), ("EXISTS", "p:2"), ("STRLEN", "p:1"), ("TTL", "p:3"), ("PING",), ("NOSUCHCOMMAND", "x"),
          ("SET", "p:1"), ("XINFO", "HELP"), ("OBJECT", "ENCODING", "p:1")]
HELD = [("SET", "p:1", "v"), ("INCR", "p:n"), ("DEL", "p:2"), ("EXPIRE", "p:3", "100"), ("PUBLISH", "c", "m"),
        ("EVAL", "return redis.call('INCR', KEYS[1])", "1", "p:m"), ("XGROUP", "CREATE", "p:s", "g", "$", "MKSTREAM")]


@pytest.mark.parametrize("how", ["dedicated", "shared"])
@pytest.mark.parametrize("seed", range(3))
def test_a_write_pause_holds_no_other_clients_reads_generated(how, seed):
    """Under CLIENT PAUSE WRITE the server holds writes (and EVAL, PUBLISH) but serves reads. With
    one shared connection a read sent behind another client's held write waited for the unpause
    (4 to 5 of 12 clients in Redis's own suite). Random pipelines from 12 clients, the pause set
    on the server directly (as a failover or an operator does). Direct (and dedicated): each
    client's replies before its own first held command come during the pause, and nothing after
    it. With shared connections: a client none of whose commands is held gets every reply during
    the pause, one that begins with a held command none, and no reply comes during the pause
    after a client's first held command (the served commands a client sent in the same write
    before its first held one may wait with it: docs/configuration.md)."""
    rng = random.Random(seed)
    plans = []
    for _ in range(12):
        plans.append([rng.choice(SERVED if rng.random() < 0.6 else HELD) for _ in range(rng.randint(1, 4))])
    r = Redis()
    kg = Keyguard(r.port, threads=1, extra=("--upstream-connections", how))
    results = {}
    try:
        for port in (r.port, kg.port):
            exact = port == r.port or how == "dedicated"
            redis.Redis(port=r.port).flushall()
            control = RespConn(r.port)
            conns = [RespConn(port, timeout=10) for _ in plans]
            for c in conns:
                assert c.call("PING") == "PONG"
            assert control.call("CLIENT", "PAUSE", "30000", "WRITE") == "OK"
            try:
                for c, plan in zip(conns, plans):
                    c.send_raw(b"".join(encode(*cmd) for cmd in plan))
                during = []
                for c, plan in zip(conns, plans):
                    first_held = next((i for i, cmd in enumerate(plan) if cmd in HELD), len(plan))
                    n = first_held if exact or first_held in (0, len(plan)) else 0
                    during.append([normal(c.value()) for _ in range(n)])
                time.sleep(EXTRA_WINDOW)  # (once for all: nothing more may have come by then)
                for c, plan, d in zip(conns, plans, during):
                    first_held = next((i for i, cmd in enumerate(plan) if cmd in HELD), len(plan))
                    if len(d) == first_held:
                        assert c.quiet(0.01) == b"", (port, plans)
            finally:
                assert control.call("CLIENT", "UNPAUSE") == "OK"
            results[port] = [d + [normal(c.value()) for _ in plan[len(d):]] for c, plan, d in zip(conns, plans, during)]
            for c in conns + [control]:
                c.close()
        def comparable(replies, plan):
            # INCR's counts depend on the order other clients' held writes ran in; a client whose
            # served commands came before its first held one may see them answered after the pause
            # (its own writes' effects included): only its number of replies is compared.
            first_held = next((i for i, cmd in enumerate(plan) if cmd in HELD), len(plan))
            if 0 < first_held < len(plan):
                return len(replies)
            return [("int",) if cmd[0] in ("INCR", "EVAL") else v for cmd, v in zip(plan, replies)]

        assert [comparable(x, p) for x, p in zip(results[kg.port], plans)] == \
            [comparable(x, p) for x, p in zip(results[r.port], plans)]
        assert kg.metric('keyguard_commands_total{command="get",outcome="failed"}') == 0
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
        r.stop()


class InjectingRelay:
    """A TCP relay to a real redis-server that adds one frame of its own (+EXTRA) right after the
    first reply carrying `token` (an ECHO's), as a server that broke the one-reply-per-command rule
    would: the fault a shared connection must not pass on to another client."""

    def __init__(self, upstream_port, token=b"$6\r\ninject\r\n"):
        self.upstream_port, self.token, self.injected = upstream_port, token, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, replies):
        try:
            while True:
                d = src.recv(65536)
                if not d:
                    break
                if replies and not self.injected and self.token in d:
                    self.injected += 1
                    at = d.index(self.token) + len(self.token)
                    d = d[:at] + b"+EXTRA\r\n" + d[at:]
                dst.sendall(d)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.listener.close()


def test_a_shared_connection_that_gets_a_frame_too_many_closes_and_passes_it_to_no_one():
    """The shared-link invariant: each command on a shared connection is answered by exactly one
    frame, in order. A server that sends one more (here a relay injects +EXTRA after an ECHO's
    reply) would shift every later reply onto another client's command; the link counts the
    breach (keyguard_shared_link_desync_total), logs it, closes, fails what was in flight with an
    error and connects again: the extra frame reaches no client, and every reply after it is its
    own command's."""
    r = Redis()
    relay = InjectingRelay(r.port)
    kg = Keyguard(relay.port, threads=1, extra=("--upstream-connections", "shared"))
    try:
        clients = [RespConn(kg.port) for _ in range(4)]
        for i, c in enumerate(clients):
            assert c.call("SET", "d:%d" % i, "v%d" % i) == "OK"
        assert clients[0].call("ECHO", "inject") == b"inject"
        wait_until(lambda: kg.metric("keyguard_shared_link_desync_total") == 1, "the breach counted")
        assert relay.injected == 1
        [event] = kg.events("shared_link_desync")
        assert event["what"] == "a reply with no command in flight", event
        got = {i: set() for i in range(len(clients))}

        def each_own():  # every client's replies are its own commands' (or an error while it reconnects)
            for i, c in enumerate(clients):
                v = c.call("GET", "d:%d" % i)
                got[i].add(v if not isinstance(v, Exception) else str(v))
            return all(b"v%d" % i in s for i, s in got.items())

        wait_until(each_own, "the shared connection made again")
        assert all(s <= {b"v%d" % i, "ERR keyguard: upstream unavailable"} for i, s in got.items()), got
        for c in clients:
            assert c.quiet() == b""
            c.close()
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
        relay.close()
        r.stop()


def adversarial_plan(rng, i):
    """One client's pipelines of state-changing commands (transactions, WATCH, subscriptions,
    RESET, HELLO, blocking commands with options in random orders, inline commands), on keys and channels of its own (one hash tag: one slot in a cluster), so that its
    replies are the same whatever the other clients do."""
    k = lambda n: "adv:{%d}:%s" % (i, n)
    ch = "advch:{%d}:" % i
    pool = [
        lambda: ("SET", k("a"), str(rng.randint(0, 9))), lambda: ("GET", k("a")), lambda: ("INCR", k("n")),
        lambda: ("LPUSH", k("l"), "x"), lambda: ("RPOP", k("l")),
        # (No CLIENT REPLY OFF/SKIP: while subscribed on RESP2 the server refuses them, and keyguard
        # without tenancy still follows them; test_reply_modes_hold_... has them. #34's note.)
        lambda: ("MULTI",), lambda: ("EXEC",), lambda: ("DISCARD",), lambda: ("WATCH", k("a")), lambda: ("UNWATCH",),
        lambda: ("SUBSCRIBE", ch), lambda: ("UNSUBSCRIBE",), lambda: ("PSUBSCRIBE", ch + "*"), lambda: ("PUNSUBSCRIBE",),
        lambda: ("PUBLISH", ch, "m"), lambda: ("PING",), lambda: ("RESET",),
        lambda: ("BLPOP", k("l"), "0.01"), lambda: ("BRPOP", k("e"), "0.01"),
        lambda: tuple(["XREAD"] + [x for pair in rng.sample([("COUNT", "1"), ("BLOCK", "10")], rng.randint(0, 2))
                                   for x in pair] + ["STREAMS", k("s"), "0"]),
        lambda: ("XADD", k("s"), "*", "f", "v"), lambda: ("HELLO", rng.choice(["2", "3"])),
        lambda: ("ECHO", "e%d" % rng.randint(0, 99)), lambda: "INLINE",
    ]
    return [[rng.choice(pool)() for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(3, 8))]


def adversarial_run(conn, plan):
    """Every reply of `plan`'s pipelines on `conn`, comparable (ids, stream ids and HELLO's map
    left out); each pipeline ends with EXEC and ECHO trailer, so that its replies
    end where they can be told (the ECHO's, or its error while subscribed)."""
    trailer = encode("EXEC") + encode("ECHO", "trailer")

    def comparable(v):
        if isinstance(v, Exception):
            return ("error", str(v).split(" ")[0])
        if isinstance(v, dict):
            return "map"
        if isinstance(v, list):
            return "hello" if v[:1] in ([b"server"], ["server"]) else [comparable(x) for x in v]
        if isinstance(v, bytes) and re.fullmatch(rb"\d{10,}-\d+", v):
            return "stream-id"
        return v

    got = []
    try:
        for batch in plan:
            conn.send_raw(b"".join(b"PING inline\r\n" if c == "INLINE" else encode(*c) for c in batch) + trailer)
            while True:
                v = conn.value()
                got.append(comparable(v))
                if v == b"trailer" or (isinstance(v, Exception) and "'echo'" in str(v)):
                    break
    except (Closed, socket.timeout) as e:
        got.append(("gone", type(e).__name__))
    conn.close()
    return got


@pytest.mark.parametrize("seed", range(3))
def test_many_clients_state_changing_pipelines_get_their_own_replies_generated(mode, seed):
    """16 clients at once, each with random pipelines of state-changing commands on its own keys
    and channels: each client's replies are exactly those of the same pipelines run alone on a
    direct connection (0 misdelivered, 0 stuck). No tenancy here (RESET would log a tenant out).
    (A prototype of it passed 40 seeds in shared mode when this was written.)"""
    if mode.name == "cluster":
        pytest.skip("a cluster's replies differ here (a reply seen in CI: an error where direct gave a "
                    "value; #34's note): to be followed")
    rng = random.Random(seed)
    plans = [adversarial_plan(rng, i) for i in range(16)]
    if mode.name == "cluster":
        kg = Keyguard(0, threads=1, upstream="redis-cluster://127.0.0.1:%d" % mode.direct_ports[0])
    else:
        kg = Keyguard(mode.direct_ports[0], threads=1, extra=("--upstream-connections", mode.name))
    try:
        mode.flush()
        direct = [adversarial_run(mode.direct_for("adv:{%d}:a" % i), p) for i, p in enumerate(plans)]
        mode.flush()
        got = [None] * len(plans)

        def client(i):
            got[i] = adversarial_run(RespConn(kg.port, timeout=20), plans[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(plans))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = [(i, plans[i], next((j, a, b) for j, (a, b) in enumerate(zip(direct[i], got[i])) if a != b)
                if len(got[i]) == len(direct[i]) else (len(direct[i]), len(got[i])))
               for i in range(len(plans)) if got[i] != direct[i]]
        assert not bad, bad
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
