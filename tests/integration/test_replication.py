"""Replication streams through keyguard: SYNC/PSYNC answer with newline keep-alives, an RDB
payload without a trailing CRLF and then commands that answer no request. keyguard forwards the
handshake, then passes the stream as it is, while the client's own requests (REPLCONF ACK) still
reach the server. redis-cli --rdb, --functions-rdb and --replica, the everyday backup and
debugging tools, work through keyguard as they do directly (each hung before)."""
import os
import subprocess
import tempfile
import threading

import pytest
import redis

from conftest import PATIENCE, Keyguard, Redis, wait_until
from resp import RespConn, encode

LIBRARY = "#!lua name=kglib\nredis.register_function('kgf', function() return 1 end)"


def new_master():
    # No 5 s wait for more replicas before a diskless transfer starts, and no PING in the stream
    # (every 10 s by default) to land in one replica's stream before the other has joined.
    r = Redis("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "3600")
    d = redis.Redis(port=r.port)
    d.set("user:1:name", "ada")
    d.hset("user:1", mapping={"name": "ada", "age": 36})
    d.rpush("queue", *range(100))
    d.zadd("board", {"a": 1, "b": 2})
    d.set("blob", b"\x00\xff" * 5000)
    d.function_load(LIBRARY)
    return r


@pytest.fixture(scope="module")
def master():
    r = new_master()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def kg(master):
    k = Keyguard(master.port)
    yield k
    assert k.stop() == 0, k.output()


def rdb_length(data, pos):
    """An RDB length encoding at pos: (value, is_special_encoding, next pos)."""
    b = data[pos]
    kind = b >> 6
    if kind == 0:
        return b & 0x3F, False, pos + 1
    if kind == 1:
        return ((b & 0x3F) << 8) | data[pos + 1], False, pos + 2
    if b == 0x80:
        return int.from_bytes(data[pos + 1:pos + 5], "big"), False, pos + 5
    if b == 0x81:
        return int.from_bytes(data[pos + 1:pos + 9], "big"), False, pos + 9
    return b & 0x3F, True, pos + 1


def rdb_string(data, pos):
    n, special, pos = rdb_length(data, pos)
    if not special:
        return data[pos:pos + n], pos + n
    width = {0: 1, 1: 2, 2: 4}[n]  # int8/16/32; LZF never appears in aux fields
    return int.from_bytes(data[pos:pos + width], "little", signed=True), pos + width


def split_rdb(data):
    """(version, aux fields, body without the checksum): aux fields hold the dump's time and
    memory figures, which differ between any two dumps; the body is the dataset itself."""
    assert data[:5] == b"REDIS", data[:20]
    pos, aux = 9, {}
    while data[pos] == 0xFA:
        k, pos = rdb_string(data, pos + 1)
        v, pos = rdb_string(data, pos)
        aux[k] = v
    return data[5:9], aux, data[pos:-8]


def cli_rdb(port, flag):
    fd, path = tempfile.mkstemp(suffix=".rdb")
    os.close(fd)
    try:
        p = subprocess.run(["redis-cli", "-p", str(port), flag, path], capture_output=True, text=True,
                           timeout=PATIENCE)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "Transfer finished with success" in p.stdout + p.stderr
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


@pytest.mark.parametrize("flag", ["--rdb", "--functions-rdb"])
def test_redis_cli_dump_through_keyguard_is_the_servers(master, kg, flag):
    direct, proxied = cli_rdb(master.port, flag), cli_rdb(kg.port, flag)
    version_d, aux_d, body_d = split_rdb(direct)
    version_p, aux_p, body_p = split_rdb(proxied)
    assert version_p == version_d and sorted(aux_p) == sorted(aux_d)
    varying = {b"ctime", b"used-mem", b"repl-offset", b"repl-id"}
    assert {k: v for k, v in aux_p.items() if k not in varying} == {k: v for k, v in aux_d.items() if k not in varying}
    assert body_p == body_d  # the dataset, byte for byte
    assert b"kglib" in body_p
    assert (b"user:1:name" in body_p) == (flag == "--rdb")  # --functions-rdb carries only functions
    assert redis.Redis(port=kg.port).ping()  # keyguard keeps serving


def test_redis_cli_replica_logs_the_masters_commands_through_keyguard(master, kg):
    # Line-buffered: redis-cli buffers its stdout fully when it is not a terminal.
    proc = subprocess.Popen(["stdbuf", "-oL", "redis-cli", "-p", str(kg.port), "--replica"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("Logging commands from master" in line for line in lines), "the replica's sync")
        d = redis.Redis(port=master.port)
        d.execute_command("set", "repl:1", "x")  # the stream carries commands as clients sent them
        d.execute_command("incr", "repl:2")
        wait_until(lambda: any(line.strip() == '"incr","repl:2"' for line in lines), "the master's INCR")
        logged = [line.strip() for line in lines[next(i for i, line in enumerate(lines)
                                                      if "Logging commands" in line) + 1:]]
        assert [line for line in logged if line.startswith('"set"') or line.startswith('"incr"')] == \
            ['"set","repl:1","x"', '"incr","repl:2"'], lines
    finally:
        proc.terminate()
        proc.wait(PATIENCE)


def read_sync_payload(c):
    """Reads keep-alive newlines and the RDB payload after SYNC/PSYNC's first line; returns the
    payload. Diskless transfers mark the end with 40 random bytes instead of giving a length."""
    while True:
        while len(c.buf) < 1:
            c._fill()
        if c.buf[:1] != b"\n":
            break
        c.buf = c.buf[1:]
    line, pos = c._line(0)
    assert line[:1] == b"$", line
    if line.startswith(b"$EOF:"):
        mark = line[5:]
        while c.buf.find(mark, pos) < 0:
            c._fill()
        end = c.buf.find(mark, pos)
        payload, c.buf = c.buf[pos:end], c.buf[end + len(mark):]
        return payload
    n = int(line[1:])
    c._need(pos + n)
    payload, c.buf = c.buf[pos:pos + n], c.buf[pos + n:]
    return payload


def replicas(d):
    return [v for k, v in d.info("replication").items() if k.startswith("slave") and isinstance(v, dict)]


def online_replicas(d):
    return sum(1 for r in replicas(d) if r.get("state") == "online")


def read_exact(c, n):
    c._need(n)
    data, c.buf = c.buf[:n], c.buf[n:]
    return data


def test_psync_stream_byte_for_byte_and_replconf_ack_reaches_the_master():
    # A master of its own: the replicas counted online below are these two alone.
    master = new_master()
    kg = Keyguard(master.port)
    try:
        psync_both(master, kg)
    finally:
        assert kg.stop() == 0, kg.output()
        master.stop()


def psync_both(master, kg):
    d = redis.Redis(port=master.port)
    conns = {}
    for name, port in (("direct", master.port), ("proxied", kg.port)):
        c = RespConn(port)
        assert c.call("REPLCONF", "capa", "eof") == "OK"
        c.send("PSYNC", "?", "-1")
        first, pos = c._line(0)
        c.buf = c.buf[pos:]
        assert first.startswith(b"+FULLRESYNC "), first
        payload = read_sync_payload(c)
        assert payload.startswith(b"REDIS") and b"user:1:name" in payload
        conns[name] = c
        # After a diskless (EOF-marked) transfer the master streams commands from the replica's
        # first ACK once it has seen the transfer end and put the replica online.
        wait_until(lambda: online_replicas(d) == len(conns), "%d replica(s) online" % len(conns))
        c.send("REPLCONF", "ACK", "0")
    # From here on both are replicas at the same point of one replication stream: the same
    # commands arrive as the same bytes.
    marker = encode("SET", "stream:0", "marker")
    d.set("stream:0", "marker")
    d.set("stream:1", "v1")
    d.delete("stream:1")
    expected = encode("SET", "stream:1", "v1") + encode("DEL", "stream:1")
    tails = {}
    for name, c in conns.items():
        got = b""
        while not got.endswith(expected):
            got += read_exact(c, 1)
        tails[name] = got[got.index(marker):]
    assert tails["direct"] == marker + expected
    assert tails["proxied"] == tails["direct"], tails
    # The replica's own requests still reach the server: REPLCONF ACK sets its offset there.
    conns["proxied"].send("REPLCONF", "ACK", "4242")

    def acked():
        return any(r.get("offset") == 4242 for r in replicas(d))
    wait_until(acked, "the master to see REPLCONF ACK 4242 from the replica behind keyguard")
    for c in conns.values():
        c.close()
    assert redis.Redis(port=kg.port).ping()


def test_sync_inside_multi_is_an_ordinary_error(master, kg):
    c = RespConn(kg.port)
    out = c.exchange(encode("MULTI") + encode("SYNC") + encode("PING") + encode("EXEC") + encode("PING"), replies=5)
    direct = RespConn(master.port).exchange(encode("MULTI") + encode("SYNC") + encode("PING") + encode("EXEC") +
                                            encode("PING"), replies=5)
    assert out == direct and out.endswith(b"+PONG\r\n"), out
