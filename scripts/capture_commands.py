#!/usr/bin/env python3
"""Captures a real redis-server's COMMAND INFO and COMMAND DOCS as JSON, the source of keyguard's
built-in command table (scripts/gen_command_table.py turns it into src/commands/command_table.inc).

usage: scripts/capture_commands.py OUT.json [PORT]   (without PORT it starts a private redis-server)
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from resp import RespConn  # noqa: E402


def text(v):
    return v.decode() if isinstance(v, bytes) else v


def pairs(flat):
    return {text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


def spec_json(raw):
    s = pairs(raw)
    bs = pairs(s["begin_search"])
    fk = pairs(s["find_keys"])
    return {
        "flags": [text(f) for f in s["flags"]],
        "begin_search": {"type": text(bs["type"]), "spec": {text(k): (text(v) if isinstance(v, bytes) else v)
                                                            for k, v in pairs(bs["spec"]).items()}},
        "find_keys": {"type": text(fk["type"]), "spec": {text(k): v for k, v in pairs(fk["spec"]).items()}},
    }


def info_json(raw):
    name, arity, flags, _first, _last, _step, cats, _tips, specs, subs = raw[:10]
    return {
        "name": text(name),
        "arity": arity,
        "flags": [text(f) for f in flags],
        "acl_categories": [text(c) for c in cats],
        "key_specs": [spec_json(s) for s in specs],
        "subcommands": sorted((info_json(s) for s in subs), key=lambda c: c["name"]),
    }


def args_json(raw):
    out = []
    for a in raw:
        d = pairs(a)
        item = {"name": text(d["name"]), "type": text(d["type"])}
        for k in ("token", "key_spec_index", "display_text"):
            if k in d:
                item[k] = text(d[k]) if isinstance(d[k], bytes) else d[k]
        item["flags"] = [text(f) for f in d.get("flags", [])]
        if "arguments" in d:
            item["arguments"] = args_json(d["arguments"])
        out.append(item)
    return out


def docs_json(raw):
    docs = {}
    d = pairs(raw)
    for name, body in d.items():
        b = pairs(body)
        docs[name] = {"arguments": args_json(b.get("arguments", []))}
        if "subcommands" in b:
            docs.update(docs_json(b["subcommands"]))
    return docs


def main():
    out = sys.argv[1]
    proc = None
    if len(sys.argv) > 2:
        port = int(sys.argv[2])
    else:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--dir", tempfile.mkdtemp()], stdout=subprocess.DEVNULL)
        time.sleep(0.5)
    try:
        c = RespConn(port)
        version = pairs(c.call("HELLO", "2"))["version"]
        infos = sorted((info_json(i) for i in c.call("COMMAND", "INFO")), key=lambda i: i["name"])
        docs = docs_json(c.call("COMMAND", "DOCS"))
        for i in infos:
            i["arguments"] = docs.get(i["name"], {}).get("arguments", [])
            for sub in i["subcommands"]:
                sub["arguments"] = docs.get(sub["name"], {}).get("arguments", [])
        with open(out, "w") as f:
            json.dump({"redis_version": text(version), "commands": infos}, f, indent=1, sort_keys=True)
            f.write("\n")
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
