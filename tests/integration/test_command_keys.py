"""Differential test of key extraction: for every command and subcommand in the table, argument
lists generated from the server's own COMMAND DOCS; keyguard's keys must equal the real server's
COMMAND GETKEYS on the same arguments. Prints coverage."""
import json
import os
import random
import subprocess
import tempfile

import pytest

from conftest import ROOT, Redis
from resp import RespConn

DATA = os.path.join(ROOT, "data", "redis-7.0.15-commands.json")
CHECK = os.path.join(os.path.dirname(os.environ.get("KEYGUARD_BIN", os.path.join(ROOT, "build", "keyguard"))),
                     "command_keys_check")


class Gen:
    def __init__(self, rng, full):
        self.rng, self.full, self.n = rng, full, 0

    def value(self, a):
        t = a["type"]
        self.n += 1
        if t == "key":
            return ["key:%d" % self.n]
        if t == "integer":
            return ["2" if a["name"] in ("numkeys", "count") else "1"]
        if t == "double":
            return ["1.5"]
        if t == "pattern":
            return ["pat*"]
        if t == "unix-time":
            return ["1700000000"]
        if t == "pure-token":
            return [a["token"]]
        if t == "oneof":
            return self.one(self.rng.choice(a["arguments"]))
        if t == "block":
            out = []
            for c in a["arguments"]:
                out += self.one(c)
            return out
        return ["s%d" % self.n]

    def one(self, a):
        flags = a.get("flags", [])
        if "optional" in flags and not (self.full or self.rng.random() < 0.5):
            return []
        reps = 2 if "multiple" in flags else 1
        out = []
        token = a.get("token") if a["type"] != "pure-token" else None
        if token and "multiple_token" not in flags:
            out.append(token)
        for _ in range(reps):
            if token and "multiple_token" in flags:
                out.append(token)
            out += self.value(a)
        return out


def cases_for(cmd, rng):
    name = cmd["name"].split("|")
    seen = set()
    for variant in range(6):
        g = Gen(rng, full=(variant == 0))
        args = list(name)
        for a in cmd.get("arguments", []):
            args += g.one(a)
        key = tuple(args)
        if key not in seen:
            seen.add(key)
            yield args


def hexs(args):
    return " ".join(a.encode().hex() or "-" for a in args)


def test_keys_match_command_getkeys_for_every_command():
    data = json.load(open(DATA))
    r = Redis()
    rng = random.Random(2026)
    try:
        c = RespConn(r.port)
        lines, with_keys, matched_cmds, total_cmds = [], set(), set(), 0
        for top in data["commands"]:
            for cmd in [top] + top["subcommands"]:
                if top["subcommands"] and cmd is top:
                    continue  # container: its subcommands are the commands
                total_cmds += 1
                for args in cases_for(cmd, rng):
                    reply = c.call("COMMAND", "GETKEYS", *args)
                    if isinstance(reply, Exception):
                        msg = str(reply)
                        if "no key arguments" in msg:
                            lines.append("%s\tK" % hexs(args))
                            matched_cmds.add(cmd["name"])
                        elif "Invalid arguments" in msg:
                            lines.append("%s\tE" % hexs(args))
                        continue  # arity errors and unknown commands say nothing about keys
                    lines.append("%s\tK %s" % (hexs(args), hexs([k.decode() for k in reply])))
                    if reply:
                        with_keys.add(cmd["name"])
                    matched_cmds.add(cmd["name"])
        with tempfile.NamedTemporaryFile("w", suffix=".cases", delete=False) as f:
            f.write("\n".join(lines) + "\n")
        out = subprocess.run([CHECK, f.name], capture_output=True, text=True)
        os.unlink(f.name)
        print("\n%d commands, %d with a case the server accepted (%d of them with keys); %s" % (
            total_cmds, len(matched_cmds), len(with_keys), out.stdout.strip().splitlines()[-1]))
        assert out.returncode == 0, out.stdout[-5000:]
        # Coverage: every command with key specs got at least one case with keys.
        keyed = {cmd["name"] for top in data["commands"] for cmd in [top] + top["subcommands"]
                 if any("not_key" not in s["flags"] for s in cmd["key_specs"])}
        missing = sorted(keyed - with_keys)
        print("commands with key specs: %d, covered with keys: %d, not covered: %s" % (
            len(keyed), len(keyed & with_keys), missing))
        assert len(keyed & with_keys) >= 0.95 * len(keyed), missing
    finally:
        r.stop()


# Words SORT and GEORADIUS take as options, put where an option's argument goes: the destination
# must be the one the server writes, whatever COMMAND GETKEYS says (for SORT it is known to be
# approximate: `SORT k STORE GET STORE x` answers `k GET`).
DECOYS = ["STORE", "GET", "BY", "LIMIT", "ASC", "DESC", "ALPHA", "STOREDIST", "COUNT", "ANY", "WITHDIST",
          "WITHHASH", "#", "0", "1", "2", "o_*", "d", "Bad Key*"]


def executed_cases(rng, n):
    """Option clauses with decoy words as their arguments, now and then a stray decoy."""
    def word():
        return rng.choice(DECOYS)
    sort = [lambda: ["BY", word()], lambda: ["GET", word()], lambda: ["LIMIT", "0", rng.choice(["5", word()])],
            lambda: ["STORE", word()], lambda: [rng.choice(["ASC", "DESC", "ALPHA"])]]
    geo = [lambda: ["STORE", word()], lambda: ["STOREDIST", word()], lambda: ["COUNT", rng.choice(["2", word()])],
           lambda: [rng.choice(["ASC", "DESC", "ANY", "WITHDIST"])]]
    for i in range(n):
        clauses = sort if i % 2 == 0 else geo
        tail = []
        for _ in range(rng.randint(1, 4)):
            tail += rng.choice(clauses)()
            if rng.random() < 0.1:
                tail.append(word())
        if i % 2 == 0:
            yield [rng.choice(["SORT", "sort"]), "src"] + tail
        else:
            yield ["GEORADIUS", "geo", "13", "38", "500", "km"] + tail


@pytest.mark.not_cluster(reason='runs SORT/GEORADIUS ... STORE on the server directly: a destination in another slot than the source is CROSSSLOT on a cluster node, so no case writes one')
def test_sort_and_georadius_keys_are_what_the_server_writes():
    """Every decoy word starts as a string key; after the command, the one whose value changed
    (or that is gone: a STORE of an empty result deletes) is the destination the server wrote."""
    r = Redis()
    rng = random.Random(7)
    try:
        c = RespConn(r.port)
        lines, stored, refused = [], 0, 0
        for args in executed_cases(rng, 600):
            c.call("FLUSHDB")
            c.call("RPUSH", "src", "3", "1", "2")
            c.call("GEOADD", "geo", "13.36", "38.11", "m")
            names = sorted(set(args[2:]) - {"src", "geo"})
            for name in names:
                c.call("SET", name, "sentinel")
            # GEORADIUS's keys are what its specs name (COMMAND GETKEYS) and the destination it
            # writes; SORT's are its source and the destination (its GETKEYS is the known-wrong guess).
            named = c.call("COMMAND", "GETKEYS", *args) if args[0] == "GEORADIUS" else Exception()
            named = [args[1]] if isinstance(named, Exception) else [k.decode() for k in named]
            reply = c.call(*args)
            written = [k for k in names if c.call("GET", k) != b"sentinel"]
            assert len(written) <= 1, (args, written)
            refused += isinstance(reply, Exception)
            stored += bool(written)
            lines.append("%s\tS %s" % (hexs(args), hexs(named + written)))
        with tempfile.NamedTemporaryFile("w", suffix=".cases", delete=False) as f:
            f.write("\n".join(lines) + "\n")
        out = subprocess.run([CHECK, f.name], capture_output=True, text=True)
        os.unlink(f.name)
        print("\n%d SORT/GEORADIUS cases: %d wrote a destination, %d refused by the server; %s"
              % (len(lines), stored, refused, out.stdout.strip().splitlines()[-1]))
        assert out.returncode == 0, out.stdout[-5000:]
        assert stored >= 100 and refused >= 100  # both kinds of outcome are exercised
    finally:
        r.stop()
