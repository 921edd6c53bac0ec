"""A Sentinel-managed upstream: a real primary, a replica and three Sentinels on loopback; keyguard
finds the primary through them and follows a failover."""
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time

import redis

from conftest import KEYGUARD, Keyguard, Redis, free_port, output_file, wait_port, wait_until
from resp import RespConn, encode

MASTER = "mymaster"


class Sentinel:
    def __init__(self, primary_port, password=None):
        self.dir = tempfile.mkdtemp(prefix="kg-sentinel-")
        self.port = free_port()
        conf = os.path.join(self.dir, "sentinel.conf")
        with open(conf, "w") as f:
            f.write("port %d\nbind 127.0.0.1\ndir %s\nsentinel resolve-hostnames yes\n"
                    "sentinel monitor %s 127.0.0.1 %d 2\nsentinel down-after-milliseconds %s 1000\n"
                    "sentinel failover-timeout %s 10000\n" % (self.port, self.dir, MASTER, primary_port, MASTER,
                                                             MASTER))
            if password is not None:
                # Clients (keyguard) and the other Sentinels must AUTH.
                f.write("requirepass %s\nsentinel sentinel-pass %s\n" % (password, password))
        self.log, out = output_file()
        with out:
            self.proc = subprocess.Popen(["redis-server", conf, "--sentinel"], stdout=out, stderr=subprocess.STDOUT)
        wait_port(self.port, proc=self.proc)
        self.client = redis.Redis(port=self.port, password=password, decode_responses=True)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def role(port):
    """The ROLE of the server on `port`; None when the connection is cut (a promoted replica's
    Sentinel kills its normal clients with CLIENT KILL TYPE normal)."""
    try:
        return redis.Redis(port=port).execute_command("ROLE")[0]
    except redis.ConnectionError:
        return None


def client_names(port):
    return redis.Redis(port=port, decode_responses=True).execute_command("CLIENT", "LIST")


@contextlib.contextmanager
def sentinel_group(password_file=None):
    """A primary, its replica in sync, three Sentinels that know the group, and keyguard in front of
    it through them: yields (primary, replica, sentinels, kg); all stopped afterwards. With
    `password_file`, the Sentinels require the password in it and keyguard reads it from there."""
    primary = Redis()
    replica = Redis("--replicaof", "127.0.0.1", str(primary.port))
    sentinels = []
    kg = None
    try:
        wait_until(lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"] == "up",
                   "the replica in sync")
        password = open(password_file).read().strip() if password_file else None
        sentinels = [Sentinel(primary.port, password) for _ in range(3)]
        # Every Sentinel knows the replica and the other two (they meet over the primary's hello channel).
        wait_until(lambda: all(len(s.client.execute_command("SENTINEL", "REPLICAS", MASTER)) == 1 and
                               len(s.client.execute_command("SENTINEL", "SENTINELS", MASTER)) == 2
                               for s in sentinels), "the Sentinels to know the group")
        url = "redis-sentinel://%s@%s" % (MASTER, ",".join("127.0.0.1:%d" % s.port for s in sentinels))
        kg = Keyguard(primary.port, upstream=url,
                      config="sentinel:\n  password_file: %s\n" % password_file if password_file else None)
        yield primary, replica, sentinels, kg
    finally:
        if kg is not None:
            kg.stop()
        for s in sentinels:
            s.stop()
        replica.stop()
        primary.stop()


def test_keyguard_finds_the_primary_and_follows_a_failover(tmp_path):
    secret = tmp_path / "sentinel-password"
    secret.write_text("old-secret\n")
    with sentinel_group(password_file=str(secret)) as (primary, replica, sentinels, kg):
        c = redis.Redis(port=kg.port)
        assert c.set("before", "1") is True
        assert redis.Redis(port=primary.port).get("before") == b"1"
        old = RespConn(kg.port)
        # (CLIENT NO-EVICT first: with shared upstream connections it gives the client a connection
        # of its own, which the server then names; keyguard keeps a shared client's name itself.)
        assert old.exchange(encode("CLIENT", "NO-EVICT", "on") + encode("CLIENT", "SETNAME", "kg-old"),
                            replies=2) == b"+OK\r\n+OK\r\n"
        assert "name=kg-old" in client_names(primary.port)
        assert kg.metric("keyguard_upstream_failovers_total") == 0
        assert kg.http("/readyz") == (200, "ready\n")

        assert sentinels[0].client.execute_command("SENTINEL", "FAILOVER", MASTER) == "OK"
        wait_until(lambda: role(replica.port) == b"master", "the replica promoted")
        wait_until(lambda: kg.metric("keyguard_upstream_failovers_total") == 1, "keyguard to follow the failover")
        # The open connection is closed (nothing was pending), so its client reconnects.
        assert old.exchange(b"", closed=True) == b"<closed>"
        # New connections go to the new primary: their writes are acknowledged by it.
        new = RespConn(kg.port)
        assert new.exchange(encode("CLIENT", "NO-EVICT", "on") + encode("CLIENT", "SETNAME", "kg-new") +
                            encode("SET", "after", "2"), replies=3) == b"+OK\r\n+OK\r\n+OK\r\n"
        assert "name=kg-new" in client_names(replica.port)
        assert redis.Redis(port=replica.port).get("after") == b"2"
        assert kg.http("/readyz") == (200, "ready\n")
        assert [e["to"] for e in kg.events("upstream_failover")] == ["127.0.0.1:%d" % replica.port]

        # sentinel.password_file is read again when it changes, as upstream_auth's is: keyguard's
        # next questions to the Sentinels (one a second) use the new password.
        assert kg.events("sentinel_recheck_failed") == []
        for s in sentinels:
            assert s.client.execute_command("ACL", "SETUSER", "default", "resetpass", ">new-secret") == "OK"
        (tmp_path / "next").write_text("new-secret\n")  # written as a Secret is: a new file moved in
        os.replace(tmp_path / "next", secret)
        wait_until(lambda: kg.events("sentinel_auth_reloaded"), "keyguard to read the new password")
        seen = len(kg.log_lines())
        time.sleep(2.2)  # two rechecks, each of which failed with the old password
        assert [e for e in kg.log_lines()[seen:] if e.get("event") == "sentinel_recheck_failed"] == []
        assert redis.Redis(port=kg.port).get("after") == b"2"


def test_a_killed_primary_under_write_load():
    """kill -9 of the primary while a client writes through keyguard: the writes fail for a window
    (measured and printed), then go to the promoted replica, and every write acknowledged after the
    window is there."""
    with sentinel_group() as (primary, replica, sentinels, kg):
        acked, failures, stop = [], [], threading.Event()

        def writer():
            c = redis.Redis(port=kg.port, socket_timeout=5)
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    assert c.set("w:%d" % i, i) is True
                    acked.append((time.monotonic(), i))
                except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError):
                    failures.append(time.monotonic())
                    time.sleep(0.01)

        t = threading.Thread(target=writer)
        t.start()
        wait_until(lambda: len(acked) >= 200, "writes through keyguard")
        killed_at = time.monotonic()
        primary.stop(signal.SIGKILL)
        wait_until(lambda: role(replica.port) == b"master", "the replica promoted")
        wait_until(lambda: kg.metric("keyguard_upstream_failovers_total") == 1, "keyguard to follow the failover")
        wait_until(lambda: acked[-1][0] > killed_at and len([a for a in acked if a[0] > killed_at]) >= 200,
                   "writes acknowledged by the new primary")
        stop.set()
        t.join()
        assert failures, "no write failed while there was no primary"
        window = max(failures) - killed_at
        resumed = min(a[0] for a in acked if a[0] > max(failures))
        print("\nkilled primary: writes failed for %.2f s (%d failed attempts), resumed %.2f s after the kill"
              % (window, len(failures), resumed - killed_at))
        assert window < 30
        # Every write acknowledged after the last failure is on the new primary.
        after = [i for ts, i in acked if ts > max(failures)]
        assert len(after) >= 200
        stored = redis.Redis(port=replica.port).mget(["w:%d" % i for i in after])
        assert stored == [str(i).encode() for i in after]
        assert [e["to"] for e in kg.events("upstream_failover")] == ["127.0.0.1:%d" % replica.port]


def test_no_sentinel_that_knows_the_master_is_a_startup_error():
    dead = free_port()
    primary = Redis()
    try:
        out = subprocess.run([KEYGUARD, "--upstream",
                              "redis-sentinel://nosuch@127.0.0.1:%d,127.0.0.1:%d" % (dead, primary.port)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert ("no Sentinel of redis-sentinel://nosuch@127.0.0.1:%d,127.0.0.1:%d gave a verified master: "
                "127.0.0.1:%d: Connection refused; 127.0.0.1:%d: does not know master 'nosuch'"
                % (dead, primary.port, dead, primary.port)) in out.stderr
    finally:
        primary.stop()
