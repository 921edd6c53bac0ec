"""Compatibility: the same commands sent to redis-server directly and through keyguard get the same
bytes back, for the replies that stretch a proxy: nested thousands of levels deep (a Lua script's
recursive table), arrays of a million elements, a 512 MB bulk, RESP3 attributes, verbatim strings,
big numbers, sets, maps and pushes mixed into pipelines, and a blocking command woken by another
connection. Each test reads exactly the frames it expects (an explicit-stack frame scanner, so depth
costs no recursion), with a generous timeout, and checks the connection still answers PING."""
import hashlib
import time

import redis

from resp import RespConn, encode

TIMEOUT = 60.0


class Conn(RespConn):
    """A raw connection that reads whole frames as bytes without parsing them into values."""

    def __init__(self, port):
        super().__init__(port, timeout=TIMEOUT)
        self.depth = 0  # the deepest nesting of the last frame read

    def frames(self, n=1):
        """Reads exactly `n` complete frames; returns their bytes."""
        out = []
        for _ in range(n):
            end = self._frame_end()
            out.append(self.buf[:end])
            self.buf = self.buf[end:]
        return b"".join(out)

    def _frame_end(self):
        # An attribute ('|') belongs to the value after it, as in keyguard's ReplyFramer: its pairs
        # are counted on the stack, and when they end the annotated value follows.
        pos = 0
        stack = []  # [elements left, is an attribute] for each open aggregate
        self.depth = 0
        while True:
            nl = self.buf.find(b"\r\n", pos)
            while nl < 0:
                self._fill()
                nl = self.buf.find(b"\r\n", pos)
            t = self.buf[pos:pos + 1]
            line = self.buf[pos + 1:nl]
            pos = nl + 2
            if t in (b"$", b"!", b"="):
                n = int(line)
                if n >= 0:
                    pos += n + 2
                    self._need(pos)
            elif t in (b"*", b"~", b"%", b">", b"|"):
                n = int(line) * (2 if t in (b"%", b"|") else 1)
                if n > 0:
                    stack.append([n, t == b"|"])
                    self.depth = max(self.depth, len(stack))
                    continue
                if t == b"|":
                    continue
            # One element is complete: close the aggregates it completes.
            while stack:
                stack[-1][0] -= 1
                if stack[-1][0] > 0:
                    break
                if stack.pop()[1]:
                    break  # an attribute ended: the value it annotates follows
            else:
                return pos

    def ping(self):
        self.send("PING")
        return self.frames(1)


def both(redis_server, keyguard, data, n, hello3=False):
    """Sends `data` to redis-server directly and through keyguard; returns (direct bytes, keyguard
    bytes, connection to keyguard) after reading exactly `n` frames from each."""
    conns = [Conn(redis_server.port), Conn(keyguard.port)]
    out = []
    for c in conns:
        if hello3:
            c.send("HELLO", "3")
            assert b"proto" in c.frames(1)  # (holds the client id: not compared)
        c.send_raw(data)
        out.append(c.frames(n))
    conns[0].close()
    return out[0], out[1], conns[1]


def expect_identical(redis_server, keyguard, data, n, hello3=False):
    direct, proxied, c = both(redis_server, keyguard, data, n, hello3)
    assert len(proxied) == len(direct)
    assert proxied == direct  # (compared after the length: a mismatch prints megabytes)
    assert c.ping() == b"+PONG\r\n"
    c.close()
    return direct


# --- deep replies ---------------------------------------------------------------------------

RECURSIVE = "local a={} local b={a} a[1]=b return a"


def test_recursive_table_byte_identical_and_connection_lives(fresh, keyguard):
    # Redis nests until Lua's stack runs out (7995 levels in 7.0), then ends with an error.
    direct = expect_identical(fresh, keyguard, encode("EVAL", RECURSIVE, "0"), 1)
    assert direct.startswith(b"*1\r\n" * 5000)
    assert direct.endswith(b"*1\r\n-ERR reached lua stack limit\r\n")
    # Pipelined between other commands, in RESP2 and RESP3.
    data = encode("SET", "k", "v") + encode("EVAL", RECURSIVE, "0") + encode("GET", "k") + encode("EVAL", RECURSIVE, "0")
    for hello3 in (False, True):
        out = expect_identical(fresh, keyguard, data, 4, hello3)
        assert out.startswith(b"+OK\r\n*1\r\n*1\r\n")
        assert b"-ERR reached lua stack limit\r\n$1\r\nv\r\n*1\r\n" in out


def test_table_nested_10000_levels(fresh, keyguard):
    # As deep as a script's table goes: Redis 7.0 stops at its Lua stack limit, short of 10000.
    script = "local t = 'leaf' for i = 1, 10000 do t = {t} end return t"
    c = Conn(fresh.port)
    c.send("EVAL", script, "0")
    c.frames(1)
    depth = c.depth
    c.close()
    assert depth > 7000
    expect_identical(fresh, keyguard, encode("EVAL", script, "0"), 1)
    # RESP3: maps, sets and arrays in turn (a set's member and a map's value hold the nesting).
    script3 = ("redis.setresp(3) local t = 'leaf' for i = 1, 10000 do "
               "if i % 3 == 0 then t = {map={k=t}} elseif i % 3 == 1 then t = {set={[t]=true}} else t = {1, t} end "
               "end return t")
    direct = expect_identical(fresh, keyguard, encode("EVAL", script3, "0"), 1, hello3=True)
    for marker in (b"%1\r\n", b"~1\r\n", b"*2\r\n"):
        assert marker in direct[:100]


# --- big replies ----------------------------------------------------------------------------

def test_million_element_arrays(fresh, keyguard):
    r = redis.Redis(port=fresh.port)
    r.eval("for i = 1, 1000000, 1000 do local batch = {} for j = i, i + 999 do batch[#batch + 1] = 'v' .. j end "
           "redis.call('RPUSH', KEYS[1], unpack(batch)) end", 1, "big:list")
    assert r.llen("big:list") == 1000000
    direct = expect_identical(fresh, keyguard, encode("LRANGE", "big:list", "0", "-1"), 1)
    assert direct.startswith(b"*1000000\r\n$2\r\nv1\r\n") and direct.endswith(b"$8\r\nv1000000\r\n")
    direct = expect_identical(fresh, keyguard, encode("EVAL", "local t = {} for i = 1, 1000000 do t[i] = i end return t",
                                                      "0"), 1)
    assert direct.startswith(b"*1000000\r\n:1\r\n:2\r\n") and direct.endswith(b":1000000\r\n")
    # A million elements, the last one nested as deep as Redis goes: the outermost level's count
    # is large while thousands of levels are open inside it.
    script = "local t = {} for i = 1, 999999 do t[i] = i end local a = {} local b = {a} a[1] = b t[1000000] = a return t"
    direct = expect_identical(fresh, keyguard, encode("EVAL", script, "0"), 1)
    assert direct.startswith(b"*1000000\r\n:1\r\n") and direct.endswith(b"*1\r\n-ERR reached lua stack limit\r\n")


def read_bulk_digest(c):
    """Reads one bulk reply in chunks; returns its header line and the SHA-1 of the rest."""
    while b"\r\n" not in c.buf:
        c._fill()
    header, rest = c.buf.split(b"\r\n", 1)
    left = int(header[1:]) + 2 - len(rest)
    h = hashlib.sha1(rest)
    c.buf = b""
    chunk = bytearray(4 << 20)
    view = memoryview(chunk)
    while left > 0:
        got = c.sock.recv_into(view, min(left, len(chunk)))
        assert got > 0, "closed"
        h.update(view[:got])
        left -= got
    assert left == 0
    return header, h.hexdigest()


# 2.4 s against the release build, 2.3 s against the ASan one (13.5 s while a build ran alongside):
# it runs in both passes.
def test_512mb_bulk(fresh, keyguard):
    r = redis.Redis(port=fresh.port)
    size = 512 * 1024 * 1024
    assert r.setrange("huge", size - 1, "x") == size
    results = []
    for port in (fresh.port, keyguard.port):
        c = Conn(port)
        c.send("GET", "huge")
        results.append(read_bulk_digest(c))
        assert c.ping() == b"+PONG\r\n"
        c.close()
    assert results[0][0] == b"$%d" % size
    assert results[1] == results[0]
    r.delete("huge")


# --- RESP3 types in pipelines ----------------------------------------------------------------

# DEBUG PROTOCOL push sends a push frame and then the reply (in RESP3): two frames.
RESP3_TYPES = ["attrib", "verbatim", "bignum", "set", "map", "push", "double", "true", "null", "array"]


def test_resp3_types_mixed_into_pipelines(fresh, keyguard):
    for hello3 in (True, False):
        data = b""
        frames = 0
        for i, t in enumerate(RESP3_TYPES):
            data += encode("SET", "k%d" % i, "v%d" % i) + encode("DEBUG", "PROTOCOL", t) + encode("GET", "k%d" % i)
            data += encode("INCRBY", "n", "0") + encode("DEBUG", "PROTOCOL", t)
            frames += 5 + (2 if t == "push" and hello3 else 0)  # two DEBUG PROTOCOL each
        data += encode("EVAL", RECURSIVE, "0") + encode("PING")
        out = expect_identical(fresh, keyguard, data * 3, 3 * (frames + 2), hello3)
        if hello3:
            for marker in (b"|1\r\n", b"=", b"(", b"~", b"%", b">2\r\n", b",", b"#t\r\n", b"_\r\n"):
                assert marker in out, marker


# --- blocking commands -----------------------------------------------------------------------

def blocked_clients(direct):
    info = direct.info("clients")
    return info["blocked_clients"]


def test_blocking_command_woken_by_another_connection(fresh, keyguard):
    direct = redis.Redis(port=fresh.port)
    out = []
    for port in (fresh.port, keyguard.port):
        waiter = Conn(port)
        # A deep reply just before it: the connection must still be there to be woken.
        waiter.send_raw(encode("EVAL", RECURSIVE, "0") + encode("BLPOP", "queue", "0"))
        out.append(waiter.frames(1))
        deadline = time.time() + TIMEOUT
        while blocked_clients(direct) != 1:
            assert time.time() < deadline, "BLPOP never blocked"
            time.sleep(0.01)  # polling a condition, not synchronising on time
        pusher = Conn(keyguard.port)
        pusher.send("RPUSH", "queue", "a", "b")
        assert pusher.frames(1) == b":2\r\n"
        out.append(waiter.frames(1))
        assert waiter.ping() == b"+PONG\r\n"
        assert direct.lpop("queue") == b"b"
        waiter.close()
        pusher.close()
    assert out[0].endswith(b"-ERR reached lua stack limit\r\n")
    assert out[1] == b"*2\r\n$5\r\nqueue\r\n$1\r\na\r\n"
    assert out[2:] == out[:2]
