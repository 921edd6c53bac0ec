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
  cannot freeze or close a connection other clients' commands share.
"""
import contextlib
import os
import random
import socket
import threading

import pytest
import redis

from cluster import cluster, seed_url
from conftest import ROOT, Keyguard, Redis
from resp import EXTRA_WINDOW, PATIENCE, Closed, RespConn

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


def neighbour_pings(mode, n, out):
    """Another tenant's `n` pipelined PINGs, answered (the replies in `out`)."""
    b = mode.tenant("bob")
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
