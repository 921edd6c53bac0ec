"""Differential tenant-isolation fuzzer (issue #12, "The fuzzer").

Tenant alice (examples/tenants.yaml: tenant:a:) sends commands generated from the argument grammar
of the captured COMMAND DOCS (data/redis-7.0.15-commands.json: every command and subcommand), then
mutated: option tokens inserted anywhere, repeated, misplaced and oddly cased, keys named like bob's
(tenant:b:...), glob metacharacters, NUL bytes, the inline form; one at a time, pipelined, inside
MULTI and under RESP3. The server holds bob's data (tenant:b:). On direct connections that bypass
keyguard the fuzzer checks, after every batch:

  (a) MONITOR: every command the server executed on alice's behalf (scripts' commands included)
      stays in db 0 and every key it names lies inside tenant:a: (the keys are what the server's own
      COMMAND GETKEYS says, asked of a second, idle redis-server, except where GETKEYS is known to
      be approximate: see `executed_violations`); keyspace patterns, SORT patterns and channels are
      confined; and no @admin/@dangerous command ran that keyguard does not confine;
  (b) no reply alice received carries bob's secret: every value, field, member, stream entry,
      group, channel, function library and client name of bob's holds MARK, and most of bob's key
      names hold it too (the others are the names alice is given to aim at; they are read through
      their values). alice's generator never produces MARK. A bare "tenant:b" in a reply proves
      nothing, because alice names her own keys tenant:b:... and gets them back;
  (c) keyspace notifications: no key outside tenant:a: (or in another db) was touched, and bob's
      data is byte-identical: the set of his key names, and each key's TYPE, DUMP and PEXPIRETIME,
      plus his channels, his function library, the server's CONFIG and ACL users (checked every
      SNAPSHOT_EVERY batches and at the end).

Commands that would stop the harness are still sent (keyguard must refuse SHUTDOWN, MONITOR,
DEBUG, CLIENT PAUSE, ...); only blocking timeouts are shortened (0 would block forever). Each batch
ends with RESET, AUTH and `PING <token>`, so whatever state the batch left (MULTI, subscribed,
CLIENT REPLY OFF, RESP3, logged out) is cleared, and the token marks the end of the batch in the
replies, in MONITOR and, through a PUBLISH on a sync channel, in the notifications.

Deterministic per seed. Env: TENANT_FUZZ_SEED (default 12), TENANT_FUZZ_BATCHES (default 10000),
TENANT_FUZZ_SECONDS (run for this long instead of a batch count). Prints coverage."""
import json
import os
import random
import re
import socket
import time
from collections import Counter

import pytest
import redis

from conftest import ROOT, Keyguard, Redis
from resp import PATIENCE, Closed, RespConn, encode
from test_tenants import CONFIG, GET_SCRIPT

DATA = os.path.join(ROOT, "data", "redis-7.0.15-commands.json")
SEED = int(os.environ.get("TENANT_FUZZ_SEED", "12"))
BATCHES = int(os.environ.get("TENANT_FUZZ_BATCHES", "10000"))
SECONDS = float(os.environ.get("TENANT_FUZZ_SECONDS", "0"))
SNAPSHOT_EVERY = 100
RESEED_EVERY = 40

MARK = "B0Bs3cr3t"  # in all of bob's data; never generated for alice
A = "tenant:a:"

# ---------------------------------------------------------------------------------------------
# The command table and its grammar.

DOCS = json.load(open(DATA))["commands"]
CATS = {}      # "client|list" -> {"@admin", ...}
LEAVES = []    # every command without subcommands, and every subcommand
CONTAINERS = set()
TOKENS = set()


def _walk_tokens(args):
    for a in args:
        if a.get("token"):
            TOKENS.add(a["token"].upper())
        _walk_tokens(a.get("arguments", []))


for _top in DOCS:
    CATS[_top["name"]] = set(_top["acl_categories"])
    _walk_tokens(_top.get("arguments", []))
    if _top["subcommands"]:
        CONTAINERS.add(_top["name"])
    else:
        LEAVES.append(_top)
    for _sub in _top["subcommands"]:
        CATS[_sub["name"]] = set(_sub["acl_categories"])
        _walk_tokens(_sub.get("arguments", []))
        LEAVES.append(_sub)
TOKEN_LIST = sorted(t for t in TOKENS if t.isalpha() or t in ("#",))

# ---------------------------------------------------------------------------------------------
# What alice has (reseeded now and then) and what bob has (never touched after setup).

OWN = ["str", "num", "list", "hash", "set", "zset", "stream", "geo", "hll", "bits", "flt", "alist"]
BOB_NAMED = ["str", "list", "hash", "set", "zset", "stream", "geo", "secret", "bhash"]
BOB_LIKE = (["tenant:b:" + n for n in BOB_NAMED] +
            ["tenant:b:*", "tenant:b:", "tenant:b", "tenant:b:str\x00", "\x00tenant:b:str", "TENANT:B:str",
             "tenant:b:{str}", "{tenant:b:}str", "tenant:*", "tenant:?:str", "tenant:[b]:str", "tenant:b:str*"])
GLOBS = ["*", "?", "[a-z]*", "[^a]*", "[^__:]*", "\\*", "*\\", "[", "[^", "[\\", "t*:b:*", "*:b:*", "**",
         "__keyspace@0__:*", "__keyspace@*__:*", "__keyspace@[^__:]*", "__keyevent@0__:*", "__key*",
         "__keyspace@0__:tenant:b:*", "__redis__:*"]
ODD = ["", "\x00", "a\x00b", " ", "\r\n", "\"", "'", "{tag}k", "\u00e9", "x" * 300, "-", "+", "$", "#",
       "nosort", "0", "1", "-1", "key with space"]
INTS = ["0", "1", "2", "3", "-1", "-2", "5", "10", "100", "1000", "abc", "1.5", "", "9223372036854775807",
        "-9223372036854775808", "18446744073709551616", " 1", "1\x00"]
DOUBLES = ["1.5", "0", "-1", "inf", "+inf", "-inf", "nan", "1e400", "abc", "13.36", "38.11", "(1", "-0"]
IDS = ["0", "$", ">", "0-0", "1-1", "*", "+", "-", "0-1", "9999999999999-0", "abc", "1-*"]
CHANNELS = ["chan", "tenant:b:chan", "tenant:b:" + "*", "__keyspace@0__:str", "__keyspace@0__:tenant:b:str",
            "__keyevent@0__:set", "__keyevent@0__:del", "__redis__:invalidate", "__keyspace@1__:str", "chan\x00"]
USERS = ["alice", "bob", "default", "mallory", "tenant:b:"]


class Gen:
    """Argument lists for one command from its COMMAND DOCS grammar, then mutated."""

    def __init__(self, rng):
        self.rng = rng

    def case(self, word):
        r = self.rng.random()
        if r < 0.6:
            return word
        if r < 0.75:
            return word.lower()
        if r < 0.9:
            return "".join(c.upper() if self.rng.random() < 0.5 else c.lower() for c in word)
        return word + self.rng.choice(["\x00", "\x00x", "\x00STORE"])  # Redis's strcasecmp stops at NUL

    def key(self):
        r = self.rng.random()
        if r < 0.55:
            return self.rng.choice(OWN)
        if r < 0.8:
            return self.rng.choice(BOB_LIKE)
        if r < 0.9:
            return self.rng.choice(GLOBS)
        return self.rng.choice(ODD)

    def string(self, name):
        rng = self.rng
        if name in ("channel", "shardchannel"):
            return rng.choice(CHANNELS)
        if name in ("id", "start", "end", "last-id", "min-idle-time", "lastid", "last_id"):
            return rng.choice(IDS)
        if name in ("group", "groupname", "consumer", "consumername"):
            return rng.choice(["g1", "c1", "g" + "2", "tenant:b:g"])
        if name in ("username",):
            return rng.choice(USERS)
        if name in ("password",):
            return rng.choice(["x", "alice", "bob", ""])
        if name in ("script",):
            return rng.choice([GET_SCRIPT, "return 1", "return redis.call('KEYS','*')",
                               "return redis.call('GET','tenant:b:str')"])
        if name in ("sha1",):
            return rng.choice(["0" * 40, "abc"])
        r = rng.random()
        if r < 0.3:
            return rng.choice(["v", "1", "2", "member", "field", "p", "m", "f1"])
        if r < 0.5:
            return self.key()
        if r < 0.6:
            return self.case(rng.choice(TOKEN_LIST))
        if r < 0.8:
            return rng.choice(GLOBS + CHANNELS)
        return rng.choice(ODD + INTS)

    def value(self, a):
        t = a["type"]
        rng = self.rng
        if t == "key":
            return [self.key()]
        if t == "integer":
            return [rng.choice(INTS[:10]) if rng.random() < 0.85 else rng.choice(INTS)]
        if t == "double":
            return [rng.choice(DOUBLES)]
        if t == "pattern":
            return [rng.choice(GLOBS + BOB_LIKE + ["*", "str*", "k?"])]
        if t == "unix-time":
            return [rng.choice(["1700000000", "0", "-1", "99999999999", "4000000000"])]
        if t == "pure-token":
            return [self.case(a["token"])]
        if t == "oneof":
            return self.one(rng.choice(a["arguments"]))
        if t == "block":
            out = []
            for c in a["arguments"]:
                out += self.one(c)
            return out
        return [self.string(a["name"])]

    def one(self, a):
        flags = a.get("flags", [])
        if "optional" in flags and self.rng.random() < 0.5:
            return []
        reps = self.rng.choice([1, 1, 2, 3]) if "multiple" in flags else 1
        out = []
        token = a.get("token") if a["type"] != "pure-token" else None
        if token and "multiple_token" not in flags:
            out.append(self.case(token))
        for _ in range(reps):
            if token and "multiple_token" in flags:
                out.append(self.case(token))
            out += self.value(a)
        return out

    def command(self, leaf):
        rng = self.rng
        head = leaf["name"].split("|")
        head = [self.case(h.upper()) if rng.random() < 0.3 else h.upper() for h in head]
        args = []
        for a in leaf.get("arguments", []):
            args += self.one(a)
        # numkeys: usually the count of what follows, sometimes not.
        for i, a in enumerate(leaf.get("arguments", [])):
            if a["name"] == "numkeys" and rng.random() < 0.7 and args:
                args[0 if i == 0 else min(len(args) - 1, 1)] = str(max(0, len(args) - 1 - (0 if i == 0 else 1)))
                break
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            self.mutate(args)
        return [h.encode() if isinstance(h, str) else h for h in head] + [x.encode("utf-8", "surrogateescape")
                                                                           for x in args]

    def mutate(self, args):
        rng = self.rng
        r = rng.random()
        pos = rng.randint(0, len(args))
        if r < 0.35:  # an option token (and maybe a value) anywhere
            ins = [self.case(rng.choice(TOKEN_LIST))]
            if rng.random() < 0.7:
                ins.append(rng.choice([self.key(), rng.choice(INTS[:6]), self.case(rng.choice(TOKEN_LIST))]))
            args[pos:pos] = ins
        elif r < 0.5 and args:  # repeat a clause
            i = rng.randrange(len(args))
            args[pos:pos] = args[i:i + rng.choice([1, 2, 3])]
        elif r < 0.6 and len(args) > 1:  # misplace
            i, j = rng.randrange(len(args)), rng.randrange(len(args))
            args[i], args[j] = args[j], args[i]
        elif r < 0.7 and args:
            del args[rng.randrange(len(args))]
        elif r < 0.85 and args:  # another tenant's name or a glob where anything was
            args[rng.randrange(len(args))] = rng.choice(BOB_LIKE + GLOBS)
        else:
            args.append(rng.choice([self.key(), rng.choice(INTS), self.case(rng.choice(TOKEN_LIST))]))


def word(b):
    """An argument as Redis's strcasecmp reads an option word: up to the first NUL, lower case."""
    return b.split(b"\x00", 1)[0].lower()


def tame(argv):
    """Blocking commands get a short timeout (0 blocks forever); nothing else is changed."""
    name = argv[0].lower()
    if name in (b"blpop", b"brpop", b"bzpopmin", b"bzpopmax", b"blmove", b"brpoplpush") and len(argv) > 2:
        argv[-1] = b"0.01"
    elif name in (b"blmpop", b"bzmpop") and len(argv) > 1:
        argv[1] = b"0.01"
    elif name in (b"xread", b"xreadgroup"):
        for i in range(1, len(argv) - 1):
            if word(argv[i]) == b"block":
                argv[i + 1] = b"10"
    elif name == b"wait":
        argv[1:] = [b"0", b"10"]
    return argv


def shape(argv):
    """An argument list's shape: the command, then each argument's class."""
    out = [argv[0].decode("latin1").lower()]
    for a in argv[1:]:
        w = word(a).decode("latin1").upper()
        if w in TOKENS and w:
            out.append(w + ("~" if b"\x00" in a else ""))
        elif b"tenant:" in a.lower():
            out.append("B")
        elif any(c in a for c in b"*?[\\"):
            out.append("G")
        elif b"\x00" in a:
            out.append("Z")
        elif re.fullmatch(rb"-?[0-9.]+", a):
            out.append("N")
        elif a.decode("latin1") in OWN:
            out.append("K")
        else:
            out.append("S")
    return " ".join(out)


def inline(argv):
    """The inline form, every argument quoted as sdssplitargs reads it."""
    def q(a):
        return b'"' + b"".join(bytes([c]) if 0x20 <= c < 0x7f and c not in b'"\\' else b"\\x%02x" % c for c in a) + b'"'
    return b" ".join(q(a) for a in argv) + b"\r\n"


# ---------------------------------------------------------------------------------------------
# What the server executed, from MONITOR.

MON_RE = re.compile(rb"^\+(\d+\.\d+) \[(\d+) ([^\]]*)\] ")
ESC = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("a"): b"\a", ord("b"): b"\b",
       ord("\\"): b"\\", ord('"'): b'"'}


def parse_monitor(line):
    """(db, client, argv) of one MONITOR line (arguments as sdscatrepr quoted them)."""
    m = MON_RE.match(line)
    assert m, line
    db, client, rest = m.group(2), m.group(3), line[m.end():]
    argv, i = [], 0
    while i < len(rest):
        assert rest[i:i + 1] == b'"', line
        i += 1
        out = bytearray()
        while rest[i:i + 1] != b'"':
            c = rest[i]
            if c == 0x5c:
                n = rest[i + 1]
                if n == ord("x"):
                    out.append(int(rest[i + 2:i + 4], 16))
                    i += 4
                    continue
                out += ESC[n]
                i += 2
                continue
            out.append(c)
            i += 1
        argv.append(bytes(out))
        i += 2  # closing quote and the space
    return db.decode(), client.decode(), argv


def is_a(b):
    return b.startswith(A.encode())


def channel_ok(ch, pattern):
    """A channel (or pattern) the server saw for alice: hers, or a keyspace channel of her keys, or
    one of Redis's shared channels whose payloads keyguard filters."""
    if is_a(ch):
        return True
    # A literal channel is a keyspace channel of the key after its head; a pattern's head must be
    # literal (a glob there could reach past the prefix).
    m = re.match(rb"__keyspace@(\d+)__:" if pattern else rb"__keyspace@.*?__:", ch, re.S)
    if m:
        return is_a(ch[m.end():])  # her prefix in any db (tenants have only db 0)
    if ch.startswith(b"__keyevent@") or ch == b"__redis__:invalidate":
        # A pattern there must not reach keyspace channels (or anything else).
        return not pattern or not any(c in ch[len(b"__keyevent@"):] for c in b"*?[\\") or \
            ch.startswith(b"__keyevent@0__:")
    return False


# @admin/@dangerous commands keyguard lets a tenant run because it confines them; each is checked
# below by what it names (keys by GETKEYS or by its own parse).
CONFINED = {
    "keys": "pattern gets the escaped prefix (checked)",
    "sort": "source, STORE and BY/GET patterns checked by sortCommand's own parse",
    "sort_ro": "as SORT",
    "info": "read-only; keyguard keeps only # Server, # Modules, # Cluster (reply checked for MARK)",
    "restore": "key checked", "restore-asking": "key checked",
    "debug": "only DEBUG OBJECT <key>: key checked",
    "memory|usage": "key checked",
}


def sort_names(argv):
    """(keys, patterns) of SORT/SORT_RO as sortCommand reads them: the source, the last STORE, and
    every BY/GET pattern. COMMAND GETKEYS is known to be approximate here (sortGetKeys does not skip
    STORE's argument: `SORT k STORE GET STORE x` answers `k GET`)."""
    keys, pats, j = [argv[1]], [], 2
    while j < len(argv):
        w = word(argv[j])
        left = len(argv) - j - 1
        if w == b"limit" and left >= 2:
            j += 2
        elif w == b"store" and left >= 1:
            keys.append(argv[j + 1])
            j += 1
        elif w in (b"by", b"get") and left >= 1:
            pats.append(argv[j + 1])
            j += 1
        j += 1
    return keys[:1] + keys[-1:] if len(keys) > 1 else keys, pats


def geo_store(argv, base):
    """The key georadiusGeneric stores into (the last STORE/STOREDIST), None when it stores none or
    refuses the options (a syntax error, COUNT <= 0, STORE with WITH*, ANY without COUNT)."""
    store, with_, any_, count, i = None, False, False, False, base
    while i < len(argv):
        w, more = word(argv[i]), i + 1 < len(argv)
        if w in (b"withdist", b"withhash", b"withcoord"):
            with_ = True
        elif w == b"any":
            any_ = True
        elif w in (b"asc", b"desc"):
            pass
        elif w == b"count" and more:
            if not re.fullmatch(rb"[0-9]+", argv[i + 1]) or int(argv[i + 1]) <= 0:
                return None
            count, i = True, i + 1
        elif w in (b"store", b"storedist") and more:
            store, i = argv[i + 1], i + 1
        else:
            return None
        i += 1
    return None if (store is not None and with_) or (any_ and not count) else store


def as_named(argv):
    """argv with the command and subcommand names cut at a NUL. The server looks names up in a
    dict whose hash covers every byte but whose compare is strcasecmp: `XINFO GROUPS\\0x k` runs
    as XINFO GROUPS when its hash falls in the bucket of "groups" (1 in 8 for XINFO's table, by
    the server's random hash seed), which is why keyguard reads a name up to a NUL. The analysis
    server's table has another seed, so it is asked about the name the command ran as."""
    out = list(argv)
    out[0] = out[0].split(b"\x00", 1)[0]
    if word(out[0]).decode("latin1") in CONTAINERS and len(out) > 1:
        out[1] = out[1].split(b"\x00", 1)[0]
    return out


def executed_violations(db, argv, getkeys, replay):
    """Why this command, executed by the server for alice, breaks isolation ([] if it does not).
    `getkeys` is the analysis server's COMMAND GETKEYS reply (a list, or an Exception)."""
    bad = []
    if db != "0":
        bad.append("ran in db %s" % db)
    argv = as_named(argv)
    name = argv[0].lower().decode("latin1")
    full = name
    if name in CONTAINERS and len(argv) > 1:
        full = name + "|" + argv[1].lower().decode("latin1")
    cats = CATS.get(full, CATS.get(name, set()))
    if cats & {"@admin", "@dangerous"} and full not in CONFINED and name not in CONFINED:
        bad.append("@admin/@dangerous command %s executed" % full)
    if name == "debug" and (len(argv) != 3 or word(argv[1]) != b"object" or not is_a(argv[2])):
        bad.append("DEBUG other than OBJECT <own key>")
    if name in ("sort", "sort_ro"):
        keys, pats = sort_names(argv)
        bad += ["key %r" % k for k in keys if not is_a(k)]
        bad += ["SORT pattern %r" % p for p in pats if p != b"#" and b"*" in p and not is_a(p)]
        return bad
    if name == "keys":
        return bad + (["KEYS pattern %r" % argv[1]] if not is_a(argv[1]) else [])
    if name == "scan":
        # As scanGenericCommand parses: option/value pairs, COUNT, MATCH or TYPE, else a syntax
        # error before any key is read; the last MATCH is the one used.
        matches, i = [], 2
        while i < len(argv):
            if i + 1 >= len(argv) or word(argv[i]) not in (b"count", b"match", b"type"):
                return bad
            if word(argv[i]) == b"match":
                matches.append(argv[i + 1])
            i += 2
        return bad + (["SCAN without a confined MATCH"] if not matches or not is_a(matches[-1]) else [])
    if name in ("select",) and argv[1:] != [b"0"]:
        bad.append("SELECT %r" % argv[1:])
    if name in ("move", "swapdb", "migrate") or (name == "copy" and b"db" in [word(a) for a in argv[3:]]):
        bad.append("reaches another database or server")
    if name in ("publish", "spublish"):
        return bad + (["channel %r" % argv[1]] if not is_a(argv[1]) else [])
    if name in ("subscribe", "ssubscribe", "unsubscribe", "sunsubscribe"):
        return bad + ["channel %r" % c for c in argv[1:] if not channel_ok(c, False)]
    if name in ("psubscribe", "punsubscribe"):
        return bad + ["pattern %r" % c for c in argv[1:] if not channel_ok(c, True)]
    if full in ("pubsub|channels", "pubsub|shardchannels"):
        # pubsubCommand lists channels only for 2 or 3 arguments; more get a syntax error.
        if len(argv) == 2 or (len(argv) == 3 and not channel_ok(argv[2], True)):
            bad.append("PUBSUB pattern %r" % argv[2:])
        return bad
    if full in ("pubsub|numsub", "pubsub|shardnumsub"):
        return bad + ["channel %r" % c for c in argv[2:] if not channel_ok(c, False)]
    if full == "pubsub|numpat":
        bad.append("PUBSUB NUMPAT counts every tenant's patterns")
    if full == "client|tracking" and len(argv) > 2:
        # As clientCommand parses: REDIRECT and PREFIX take the next argument; an unknown word is
        # a syntax error and tracking is left as it was.
        prefixes, bcast, j = [], False, 3
        while j < len(argv):
            w = word(argv[j])
            if w in (b"redirect", b"prefix") and j + 1 < len(argv):
                if w == b"prefix":
                    prefixes.append(argv[j + 1])
                j += 1
            elif w == b"bcast":
                bcast = True
            elif w not in (b"optin", b"optout", b"noloop"):
                return bad
            j += 1
        bad += ["tracking prefix %r" % p for p in prefixes if not is_a(p)]
        if bcast and not prefixes and word(argv[2]) == b"on":
            bad.append("BCAST tracking without a prefix")
        return bad
    if name in ("georadius", "georadiusbymember", "georadius_ro", "georadiusbymember_ro"):
        # GETKEYS (georadiusGetKeys) names every STORE/STOREDIST argument, also when
        # georadiusGeneric's option parse fails and nothing is written: its parse decides.
        keys = [argv[1]]
        store = geo_store(argv, 6 if name.startswith("georadius") and "member" not in name else 5)
        if store is not None:
            keys.append(store)
        return bad + ["key %r" % k for k in keys if not is_a(k)]
    if name in ("eval", "eval_ro", "evalsha", "evalsha_ro", "fcall", "fcall_ro") and len(argv) > 2 and \
            not re.fullmatch(rb"-?[1-9][0-9]*|0", argv[2]):
        return bad  # evalGenericCommand refuses a numkeys that is not an integer; GETKEYS reads "1.5" as 1
    if isinstance(getkeys, Exception):
        msg = str(getkeys)
        # "no key arguments": none to check. "Invalid arguments" (a getkeys proc that cannot parse
        # the arguments): the command is replayed on the empty analysis server, where it must fail
        # too (its own parse refuses what its getkeys proc cannot read, so it touched no key);
        # what touches data anyway shows in the notifications, bob's snapshot and MARK.
        if "no key arguments" not in msg and not (msg.startswith("ERR Invalid arguments") and
                                                  isinstance(replay(argv), Exception)):
            bad.append("COMMAND GETKEYS cannot name the keys (%s) and the command succeeds" % msg)
    elif getkeys is not None:
        bad += ["key %r" % k for k in getkeys if not is_a(k)]
    return bad


# ---------------------------------------------------------------------------------------------
# Harness connections.

class Lines:
    """A direct connection read line by line (MONITOR) or frame by frame (pub/sub)."""

    def __init__(self, port):
        self.c = RespConn(port)

    def addr(self):
        h, p = self.c.sock.getsockname()
        return "%s:%d" % (h, p)


def addr_of(sock):
    h, p = sock.getsockname()
    return "%s:%d" % (h, p)


class Alice:
    def __init__(self, port):
        self.port = port
        self.c = None
        self.resp3 = False

    def login(self, resp3):
        if self.c is not None:
            self.c.close()
        self.c = RespConn(self.port)
        self.resp3 = resp3
        self.c.send_raw(self.auth())
        self.c.read()

    def auth(self):
        if self.resp3:
            return encode("HELLO", "3", "AUTH", "alice", "alice-secret")
        return encode("AUTH", "alice", "alice-secret")

    def run(self, payload, token):
        """Sends the batch and the trailer; returns (bytes of every reply up to the token's, closed)."""
        end = encode("PING", token)
        self.c.send_raw(payload + encode("RESET") + self.auth() + end)
        out = []
        while True:
            try:
                _, raw = self.c.read()
            except (Closed, ConnectionResetError):
                # Closed (QUIT, or keyguard's own close): the token goes on a new login, so that
                # MONITOR and the notifications still see where this batch ends.
                self.login(self.resp3)
                self.c.send_raw(end)
                assert self.c.read()[1] == b"$%d\r\n%s\r\n" % (len(token), token.encode())
                return b"".join(out), True
            if raw == b"$%d\r\n%s\r\n" % (len(token), token.encode()):
                return b"".join(out), False
            out.append(raw)


def snapshot(d):
    """Everything of bob's, and the server-wide state a tenant must not change."""
    keys, cursor = [], b"0"
    while True:
        cursor, batch = d.execute_command("SCAN", cursor, "COUNT", 1000)
        keys += batch
        if cursor in (b"0", 0):
            break
    bob = sorted(k for k in keys if not is_a(k))
    p = d.pipeline(transaction=False)
    for k in bob:
        p.type(k)
        p.dump(k)
        p.execute_command("PEXPIRETIME", k)
    vals = p.execute()
    return {
        "keys": bob,
        "count": len(bob),
        "values": {k: tuple(vals[3 * i:3 * i + 3]) for i, k in enumerate(bob)},
        "channels": sorted(c for c in d.execute_command("PUBSUB", "CHANNELS") if not is_a(c)),
        "numpat": d.execute_command("PUBSUB", "NUMPAT"),
        "bob_clients": sorted(re.findall(rb"name=(%s\S*)" % MARK.encode(), d.execute_command("CLIENT", "LIST"))),
        "functions": repr(d.execute_command("FUNCTION", "LIST", "WITHCODE")),
        "config": repr(sorted(zip(*[iter(d.execute_command("CONFIG", "GET", "*"))] * 2))),
        "acl": d.execute_command("ACL", "LIST"),
        "script": d.execute_command("SCRIPT", "EXISTS", BOB_SCRIPT_SHA),
    }


BOB_SCRIPT = "return '%s'" % MARK
BOB_SCRIPT_SHA = None


def seed_bob(d, bob_conns, port):
    global BOB_SCRIPT_SHA
    v = MARK + "-value"
    d.set("tenant:b:str", v)
    d.set("tenant:b:secret", v + "-secret")
    d.rpush("tenant:b:list", v + "-1", v + "-2")
    d.hset("tenant:b:hash", mapping={MARK + "-f": v})
    d.hset("tenant:b:bhash", "f", v)
    d.sadd("tenant:b:set", MARK + "-m1", MARK + "-m2")
    d.zadd("tenant:b:zset", {MARK + "-z1": 1, MARK + "-z2": 2})
    d.xadd("tenant:b:stream", {MARK + "-field": v}, id="1-1")
    d.xgroup_create("tenant:b:stream", MARK + "-group", id="0")
    d.geoadd("tenant:b:geo", (13.36, 38.11, MARK + "-place"))
    for i in range(24):
        k = "tenant:b:%s-hidden-%d" % (MARK, i)
        kind = i % 6
        if kind == 0:
            d.set(k, v)
        elif kind == 1:
            d.rpush(k, v)
        elif kind == 2:
            d.hset(k, MARK, v)
        elif kind == 3:
            d.sadd(k, v)
        elif kind == 4:
            d.zadd(k, {v: 1})
        else:
            d.pfadd(k, v)
        if i % 4 == 0:
            d.pexpireat(k, 4102444800000)  # 2100: PEXPIRETIME must not change
    d.execute_command("FUNCTION", "LOAD", "#!lua name=%slib\nredis.register_function('%sfn', function() return '%s' end)"
                      % (MARK, MARK, MARK))
    BOB_SCRIPT_SHA = d.script_load(BOB_SCRIPT)
    # bob's live connections: a named client, a subscriber to his channel and to a pattern.
    c = RespConn(port)
    c.call("CLIENT", "SETNAME", MARK + "-client")
    c.call("SUBSCRIBE", "tenant:b:%s-chan" % MARK)
    bob_conns.append(c)
    c = RespConn(port)
    c.call("PSUBSCRIBE", "tenant:b:%s-pat*" % MARK)
    bob_conns.append(c)


def seed_alice(d):
    p = d.pipeline(transaction=False)
    for k in OWN:  # one DEL a key: on a cluster node (KEYGUARD_UPSTREAM=cluster) a DEL of keys in several slots is CROSSSLOT
        p.delete(A + k)
    p.set(A + "str", "hello")
    p.set(A + "num", "10")
    p.set(A + "flt", "1.5")
    p.rpush(A + "list", "3", "1", "2")
    p.rpush(A + "alist", "b", "a", "tenant:b:str")
    p.hset(A + "hash", mapping={"f1": "v1", "f2": "2"})
    p.sadd(A + "set", "m1", "m2", "1")
    p.zadd(A + "zset", {"m1": 1, "m2": 2})
    p.xadd(A + "stream", {"f": "v"}, id="1-1")
    p.xgroup_create(A + "stream", "g1", id="0")
    p.geoadd(A + "geo", (13.36, 38.11, "p"))
    p.pfadd(A + "hll", "a", "b")
    p.setbit(A + "bits", 7, 1)
    p.execute()


# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers():
    r = Redis("--notify-keyspace-events", "KEA")
    analysis = Redis()  # COMMAND GETKEYS is asked here, away from MONITOR
    yield r, analysis
    r.stop()
    analysis.stop()


def test_tenant_fuzz(servers):
    server, analysis = servers
    kg = Keyguard(server.port, config=CONFIG)
    rng = random.Random(SEED)
    gen = Gen(rng)
    d = redis.Redis(port=server.port, client_name="fuzz-harness")
    d.flushall()
    d.execute_command("FUNCTION", "FLUSH")
    d.script_flush()
    bob_conns = []
    seed_bob(d, bob_conns, server.port)
    seed_alice(d)
    getkeys = RespConn(analysis.port)
    mon = RespConn(server.port)
    assert mon.call("MONITOR") == "OK"
    notes = RespConn(server.port)
    notes.call("PSUBSCRIBE", "__key*__:*")
    notes.call("SUBSCRIBE", "fuzz-sync")
    sync = redis.Redis(port=server.port, client_name="fuzz-harness")
    sync.ping()
    harness = {addr_of(mon.sock), addr_of(notes.sock)}
    for c in bob_conns:
        harness.add(addr_of(c.sock))

    def refresh_harness():
        """The fuzzer's own redis-py connections (a pipeline may open one) are named."""
        harness.update(c["addr"] for c in d.client_list() if c.get("name") == "fuzz-harness")

    before = snapshot(d)
    refresh_harness()
    alice = Alice(kg.port)
    alice.login(False)

    stats = Counter()
    leaves_seen, shapes, executed_names = set(), set(), Counter()
    violations = []
    order = list(range(len(LEAVES)))
    rng.shuffle(order)
    cursor = 0
    start = time.monotonic()
    batch_no = 0

    def next_leaf():
        nonlocal cursor
        if cursor < len(order):  # every command and subcommand first, in a seeded order
            cursor += 1
            return LEAVES[order[cursor - 1]]
        return rng.choice(LEAVES)

    def replay(argv):
        stats["replayed"] += 1
        v = getkeys.call(*argv)
        getkeys.call("FLUSHALL")
        return v

    def fail(what, batch):
        lines = "\n".join("  %r" % a for a in batch)
        pytest.fail("seed %d, batch %d: %s\nbatch (%s):\n%s" % (SEED, batch_no, what, mode, lines))

    while (time.monotonic() - start < SECONDS) if SECONDS else (batch_no < BATCHES):
        batch_no += 1
        token = "fuzz-end-%d" % batch_no
        if batch_no % RESEED_EVERY == 0:
            seed_alice(d)
            refresh_harness()
        mode = rng.choice(["single", "single", "pipeline", "pipeline", "multi", "resp3"])
        if (mode == "resp3") != alice.resp3 or rng.random() < 0.02:
            alice.login(mode == "resp3")
            stats["connections"] += 1
        n = 1 if mode == "single" else rng.randint(2, 8)
        batch = []
        for _ in range(n):
            leaf = next_leaf()
            leaves_seen.add(leaf["name"])
            argv = tame(gen.command(leaf))
            batch.append(argv)
            shapes.add(shape(argv))
        if mode == "multi":
            batch = [[b"MULTI"]] + batch + [[rng.choice([b"EXEC", b"EXEC", b"DISCARD"])]]
        payload = b""
        for argv in batch:
            if rng.random() < 0.08 and b"\n" not in b"".join(argv):
                payload += inline(argv)
                stats["inline"] += 1
            else:
                payload += encode(*argv)
        stats["commands"] += len(batch)
        stats["batches_" + mode] += 1
        try:
            out, closed = alice.run(payload, token)
        except socket.timeout:
            fail("no reply to the batch's trailer within %d s (received %r)" % (PATIENCE, alice.c.buf[:2000]), batch)
        stats["reply_bytes"] += len(out)
        stats["closed"] += closed
        # (b) replies
        if MARK.encode() in out:
            fail("a reply carries bob's data: %r" % out[max(0, out.find(MARK.encode()) - 300):][:600], batch)
        stats["replies_with_own_prefix"] += A.encode() in out
        # (a) MONITOR, up to the trailer's PING token
        execd = []
        while True:
            line, _ = mon._line(0)
            raw, mon.buf = mon.buf[:len(line) + 2], mon.buf[len(line) + 2:]
            db, client, argv = parse_monitor(raw[:-2])
            if client in harness:
                continue
            if argv == [b"PING", token.encode()]:
                break
            execd.append((db, argv))
        checks = []
        for db, argv in execd:
            name = word(argv[0]).decode("latin1")
            executed_names[name] += 1
            checks.append((db, argv))
        stats["executed"] += len(checks)
        if checks:
            # A command without arguments names no key (and GETKEYS wants at least one).
            getkeys.send_raw(b"".join(encode(b"COMMAND", b"GETKEYS", *as_named(argv)) for _, argv in checks
                                      if len(argv) > 1))
            gks = [getkeys.value() if len(argv) > 1 else None for _, argv in checks]
            for (db, argv), gk in zip(checks, gks):
                bad = executed_violations(db, argv, gk, replay)
                if bad:
                    fail("the server executed %r for alice: %s" % (argv, "; ".join(bad)), batch)
        # (c) notifications, up to the sync message
        sync.publish("fuzz-sync", token)
        while True:
            v = notes.value()
            if v[0] == b"message":
                if v[2] == token.encode():
                    break
                continue
            ch, payload_key = v[2], v[3]
            m = re.match(rb"__key(space|event)@(\d+)__:", ch)
            key = ch[m.end():] if m.group(1) == b"space" else payload_key
            stats["notifications"] += 1
            if m.group(2) != b"0" or not is_a(key):
                fail("keyspace notification %r %r: a key outside tenant:a: was touched" % (ch, payload_key), batch)
        if batch_no % SNAPSHOT_EVERY == 0:
            now = snapshot(d)
            refresh_harness()
            if now != before:
                fail("bob's data or the server's state changed: %s" % diff(before, now), batch)
    after = snapshot(d)
    assert after == before, diff(before, after)
    elapsed = time.monotonic() - start
    all_leaves = {leaf["name"] for leaf in LEAVES}
    print("\ntenant fuzz: seed %d, %d batches in %.1f s; commands+subcommands %d/%d (%d top-level), "
          "%d argument shapes, %d commands sent (%d inline), %d executed by the server (%d distinct), "
          "%d replayed for want of GETKEYS, %d keyspace notifications checked, %d reply bytes, %d connections closed; "
          "modes %s; replies showing tenant:a: %d" % (
              SEED, batch_no, elapsed, len(leaves_seen & all_leaves), len(all_leaves),
              len({n.split("|")[0] for n in leaves_seen}), len(shapes), stats["commands"], stats["inline"],
              stats["executed"], len(executed_names), stats["replayed"], stats["notifications"], stats["reply_bytes"],
              stats["closed"], {k[8:]: v for k, v in stats.items() if k.startswith("batches_")},
              stats["replies_with_own_prefix"]))
    print("executed: %s" % ", ".join("%s %d" % kv for kv in sorted(executed_names.items())))
    if not SECONDS and BATCHES * 3 >= len(LEAVES):
        assert leaves_seen >= all_leaves
    assert kg.stop() == 0, kg.output()


def diff(a, b):
    out = []
    for k in a:
        if a[k] != b[k]:
            if k == "values":
                ks = [x for x in set(a[k]) | set(b[k]) if a[k].get(x) != b[k].get(x)]
                out.append("values of %r" % sorted(ks)[:10])
            else:
                out.append("%s: %r -> %r" % (k, str(a[k])[:300], str(b[k])[:300]))
    return "; ".join(out)
