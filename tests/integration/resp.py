"""A small RESP2/RESP3 client on a raw socket, for tests that assert exact reply bytes, push frames
and protocol errors (things redis-py 4.3, which speaks RESP2 only, cannot show)."""
import socket

# The bound on anything a test waits for: generous, because a loaded machine is slow, and never
# reached by a passing run, which returns as soon as what it waits for has arrived.
PATIENCE = 60.0
# How long a test watches for something that must NOT arrive (an extra reply, a leaked message).
EXTRA_WINDOW = 0.3


class Push(list):
    """A RESP3 push frame ('>')."""


class Attr(dict):
    pass


def encode(*args):
    out = b"*%d\r\n" % len(args)
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return out


class Closed(Exception):
    pass


class RespConn:
    def __init__(self, port, host="127.0.0.1", timeout=PATIENCE):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""

    def close(self):
        self.sock.close()

    def send(self, *args):
        self.sock.sendall(encode(*args))

    def send_raw(self, data):
        self.sock.sendall(data)

    def _fill(self):
        d = self.sock.recv(1 << 20)
        if not d:
            raise Closed()
        self.buf += d

    def _line(self, pos):
        while True:
            i = self.buf.find(b"\r\n", pos)
            if i >= 0:
                return self.buf[pos:i], i + 2
            self._fill()

    def _need(self, end):
        while len(self.buf) < end:
            self._fill()

    def _parse(self, pos):
        line, pos = self._line(pos)
        t, rest = line[:1], line[1:]
        if t in (b"+",):
            return rest.decode("latin1"), pos
        if t == b"-":
            return Exception(rest.decode("latin1")), pos
        if t == b":":
            return int(rest), pos
        if t == b"_":
            return None, pos
        if t == b",":
            return float(rest), pos
        if t == b"#":
            return rest == b"t", pos
        if t == b"(":
            return int(rest), pos
        if t in (b"$", b"!", b"="):
            n = int(rest)
            if n < 0:
                return None, pos
            self._need(pos + n + 2)
            data = self.buf[pos:pos + n]
            if t == b"!":
                return Exception(data.decode("latin1")), pos + n + 2
            return data, pos + n + 2
        if t in (b"*", b"~", b">"):
            n = int(rest)
            if n < 0:
                return None, pos
            items = []
            for _ in range(n):
                v, pos = self._parse(pos)
                items.append(v)
            if t == b"~":
                return ("set", items), pos
            return (Push(items) if t == b">" else items), pos
        if t == b"%":
            n = int(rest)
            d = {}
            for _ in range(n):
                k, pos = self._parse(pos)
                v, pos = self._parse(pos)
                d[k if not isinstance(k, list) else tuple(k)] = v
            return d, pos
        if t == b"|":
            n = int(rest)
            for _ in range(2 * n):
                _, pos = self._parse(pos)
            v, pos = self._parse(pos)
            return v, pos
        raise ValueError("bad type byte %r in %r" % (t, self.buf[:100]))

    def read(self):
        """Reads one reply; returns (value, exact bytes)."""
        while not self.buf:
            self._fill()
        v, pos = self._parse(0)
        raw, self.buf = self.buf[:pos], self.buf[pos:]
        return v, raw

    def value(self):
        return self.read()[0]

    def call(self, *args):
        self.send(*args)
        return self.value()

    def read_until_closed(self, timeout=PATIENCE):
        """Everything the server sends until it closes the connection."""
        self.sock.settimeout(timeout)
        data = self.buf
        self.buf = b""
        while True:
            d = self.sock.recv(1 << 20)
            if not d:
                return data
            data += d

    def exchange(self, data, replies=0, closed=False, timeout=PATIENCE):
        """Sends raw bytes, reads exactly `replies` complete replies (a push, a pub/sub message and
        an attribute with its value each count as one), with closed=True then everything until the
        server closes, and returns their exact bytes, with b"<closed>" appended when the server
        closed. Nothing here waits for a quiet connection: whatever a test expects is read however
        slowly it comes (up to `timeout`), and anything beyond it that arrives within EXTRA_WINDOW
        is appended so that an extra reply fails the comparison; one arriving later only goes
        unseen, so a slow machine can hide a bug here but never fail a good run."""
        self.sock.sendall(data)
        self.sock.settimeout(timeout)
        out = b""
        try:
            for _ in range(replies):
                out += self.read()[1]
            if closed:
                return out + self.read_until_closed(timeout) + b"<closed>"
        except Closed:
            out, self.buf = out + self.buf, b""
            return out + b"<closed>"
        return out + self.quiet()

    def quiet(self, window=EXTRA_WINDOW):
        """Whatever arrives within `window`: for asserting that nothing (more) arrives. A slow
        machine can only make this miss a late byte, never invent one."""
        self.sock.settimeout(window)
        out, self.buf = self.buf, b""
        try:
            while True:
                d = self.sock.recv(1 << 20)
                if not d:
                    return out + b"<closed>"
                out += d
        except socket.timeout:
            return out
        finally:
            self.sock.settimeout(PATIENCE)
