"""keyguard's socket reads (src/proxy/async_read.h): a read that empties the socket lets the next
one wait for epoll without an EAGAIN recv(), so a command at pipeline depth 1 costs one recv and
one send per direction; and no byte is ever left waiting in a socket: bytes that arrive while
keyguard is not reading (backpressure), backlogs larger than the read buffer, and bytes that
trickle in one at a time."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import redis

from conftest import Keyguard, Redis, wait_blocked, wait_until
from resp import RespConn, encode

BARE = "key_policy: {enabled: false}\nhygiene: {enabled: false}\n"
# The smallest read buffer: most reads fill it, so the read after one must try recv() first.
SMALL_READS = "limits: {read_buffer_size: 512}\n"


@pytest.fixture(scope="module")
def server():
    r = Redis()
    yield r
    r.stop()


def strace_counts(path):
    """{syscall: calls} from an `strace -c` summary."""
    counts = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[3].isdigit() and parts[-1] != "total":
                counts[parts[-1]] = int(parts[3])
    return counts


def test_a_command_at_depth_one_costs_one_read_and_one_write_per_direction(server):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    kg = Keyguard(server.port, config=BARE, threads=1)
    c = RespConn(kg.port)
    c.send("PING")
    assert c.value() == "PONG"
    out = tempfile.NamedTemporaryFile(prefix="kg-strace-", delete=False)
    out.close()
    tracer = subprocess.Popen(
        ["strace", "-f", "-c", "-o", out.name, "-e", "trace=recvfrom,recvmsg,read,sendto,sendmsg,write,writev",
         "-p", str(kg.proc.pid)], stderr=subprocess.PIPE)
    try:
        # "Process N attached [with M threads]" once it traces every thread.
        line = tracer.stderr.readline()
        if b"attached" not in line:
            pytest.skip("strace cannot attach (ptrace not permitted?): %r" % line)
        n = 1000
        for i in range(n // 2):
            c.send("SET", "k%d" % i, "v")
            assert c.value() == "OK"
            c.send("GET", "k%d" % i)
            assert c.value() == b"v"
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(60)
        c.close()
        kg.stop()
    counts = strace_counts(out.name)
    os.unlink(out.name)
    reads = counts.get("recvfrom", 0) + counts.get("recvmsg", 0) + counts.get("read", 0)
    writes = sum(counts.get(s, 0) for s in ("sendto", "sendmsg", "write", "writev"))
    print("\n%d commands at depth 1: %.2f reads, %.2f writes per command" % (n, reads / n, writes / n))
    # Exactly 2 and 2 (client and upstream); Asio's speculative reads made it 4 reads (2 EAGAIN).
    assert reads <= 2.1 * n, counts
    assert writes <= 2.1 * n, counts


def test_bytes_that_arrive_while_keyguard_waits_for_a_reply_slot_are_read(server):
    # max_pending_commands 1: with the BLPOP pending keyguard does not read the client; the PING
    # arrives meanwhile (an epoll edge with no read queued) and must be read once the BLPOP ends.
    kg = Keyguard(server.port, config=BARE + "limits: {max_pending_commands: 1}\n", threads=1)
    direct = redis.Redis(port=server.port)
    try:
        c = RespConn(kg.port)
        for i in range(3):
            c.send("BLPOP", "kg:reads:list", "0")
            wait_blocked(server.port)
            c.send("PING")
            direct.lpush("kg:reads:list", "x%d" % i)
            assert c.value() == [b"kg:reads:list", b"x%d" % i]
            assert c.value() == "PONG"
        c.close()
    finally:
        direct.close()
        assert kg.stop() == 0


def test_replies_that_arrive_while_the_client_does_not_read_are_all_delivered(server):
    # A small output limit: keyguard stops reading the server while the client lags, and the
    # server's next replies arrive meanwhile.
    kg = Keyguard(server.port, config=BARE + "limits: {max_output_buffer: 4096, read_buffer_size: 512}\n",
                  threads=1)
    try:
        big = os.urandom(1 << 20)
        redis.Redis(port=server.port).set("kg:reads:big", big)
        c = RespConn(kg.port)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        # 64 MB of replies: more than the kernel's socket buffers between the server and keyguard
        # can hold (tcp_rmem's maximum is 6 MB on Debian, 32 MB on some machines, plus the
        # server's send buffer), so whatever the machine, the server must hold some of them.
        replies = 64
        c.send_raw(encode("GET", "kg:reads:big") * replies + encode("PING"))
        # The client's window fills, keyguard stops reading the server, and the server holds the
        # rest of the replies in its output buffer.
        direct = redis.Redis(port=server.port)
        wait_until(lambda: any(int(cl["omem"]) > 0 for cl in direct.client_list()), "the server's output held")
        direct.close()
        for _ in range(replies):
            assert c.value() == big
        assert c.value() == "PONG"
        c.close()
    finally:
        assert kg.stop() == 0


@pytest.mark.parametrize("config", [BARE, BARE + SMALL_READS])
def test_backlogs_larger_than_a_read(server, config):
    kg = Keyguard(server.port, config=config, threads=1)
    try:
        c = RespConn(kg.port)
        # 20000 commands (about 600 KB) in one write, then their replies.
        n = 20000
        c.send_raw(b"".join(encode("SET", "kg:reads:%d" % i, "v%d" % i) for i in range(n)))
        for _ in range(n):
            assert c.value() == "OK"
        c.send_raw(b"".join(encode("GET", "kg:reads:%d" % i) for i in range(n)))
        for i in range(n):
            assert c.value() == b"v%d" % i
        # Multi-MB values both ways, then a small command on the same connection.
        for size in (1 << 20, (8 << 20) + 7):
            value = os.urandom(size)
            c.send("SET", "kg:reads:big", value)
            assert c.value() == "OK"
            c.send("GET", "kg:reads:big")
            assert c.value() == value
            c.send("PING")
            assert c.value() == "PONG"
        c.close()
    finally:
        assert kg.stop() == 0


def test_a_command_that_trickles_in_byte_by_byte(server):
    kg = Keyguard(server.port, config=BARE, threads=1)
    try:
        c = RespConn(kg.port)
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for b in encode("SET", "kg:reads:t", "trickled"):
            c.send_raw(bytes([b]))
            time.sleep(0.002)  # each byte its own segment: a short read, then a wait
        assert c.value() == "OK"
        c.send("GET", "kg:reads:t")
        assert c.value() == b"trickled"
        c.close()
    finally:
        assert kg.stop() == 0
