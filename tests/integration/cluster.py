"""A real Redis Cluster on loopback for the tests: six redis-server processes (three primaries, a
replica each) joined with `redis-cli --cluster create`, and helpers that add a primary, reshard,
fail over and kill its nodes. Everything here talks to the nodes directly, never through keyguard."""
import contextlib
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from conftest import file_output, free_port, output_file, start_listening, wait_until
from resp import PATIENCE

SLOTS = 16384


class Node:
    """One cluster-enabled redis-server in its own directory (its nodes.conf is there)."""

    def __init__(self, node_timeout_ms, tls=None):
        """`tls`: {"cert", "key", "ca"} paths: the node serves TLS only (clients, the cluster bus
        and replication), and CLUSTER SLOTS names its TLS port."""
        self.dir = tempfile.mkdtemp(prefix="kg-cluster-")
        self.tls = tls

        def start():
            # The bus port is port + 10000 unless given: ephemeral ports above 55535 would not do.
            self.port, self.bus_port = free_port(), free_port()
            self.log, out = output_file()
            ports = ["--port", str(self.port)]
            if tls is not None:
                ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cluster", "yes", "--tls-replication", "yes",
                         "--tls-cert-file", tls["cert"], "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"],
                         "--tls-auth-clients", "no"]
            self.proc = subprocess.Popen(
                ["redis-server", *ports, "--bind", "127.0.0.1", "--dir", self.dir,
                 "--cluster-enabled", "yes", "--cluster-port", str(self.bus_port),
                 "--cluster-config-file", "nodes-%d.conf" % self.port,
                 "--cluster-node-timeout", str(node_timeout_ms), "--appendonly", "no", "--save", "",
                 "--enable-debug-command", "yes",
                 # A replica syncs at once (diskless syncs wait 5 s by default for more replicas).
                 "--repl-diskless-sync-delay", "0",
                 # CLUSTER SLOTS lists a replica only once its replication offset is not 0, which
                 # on an idle primary takes the first replication PING (10 s by default).
                 "--repl-ping-replica-period", "1"],
                stdout=out, stderr=subprocess.STDOUT)
            out.close()
            return self.proc, file_output(self.log), [self.port, self.bus_port]

        try:
            start_listening("cluster redis-server", start)
        except BaseException:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        extra = {} if tls is None else {"ssl": True, "ssl_ca_certs": tls["ca"], "ssl_check_hostname": False}
        self.client = redis.Redis(port=self.port, decode_responses=True, socket_timeout=PATIENCE, **extra)

    def alive(self):
        return self.proc.poll() is None

    def output(self):
        return file_output(self.log)()

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(PATIENCE)
        self.client.close()


def _normalized_slots(reply):
    """CLUSTER SLOTS as a sorted tuple of (start, end, primary port, sorted replica ports): the
    order of the ranges and of the replicas in a reply is not significant."""
    return tuple(sorted((int(r[0]), int(r[1]), int(r[2][1]), tuple(sorted(int(n[1]) for n in r[3:])))
                        for r in reply))


def parse_nodes(text):
    """CLUSTER NODES as dicts: id, port, flags (a set), master (id or None), slots (a list of
    (start, end); importing/migrating markers left out), link."""
    nodes = []
    for line in text.strip().splitlines():
        f = line.split()
        addr = f[1].split("@")[0]
        slots = []
        for s in f[8:]:
            if s.startswith("["):
                continue
            a, _, b = s.partition("-")
            slots.append((int(a), int(b or a)))
        nodes.append({"id": f[0], "port": int(addr.rsplit(":", 1)[1]), "flags": set(f[2].split(",")),
                      "master": None if f[3] == "-" else f[3], "link": f[7], "slots": slots})
    return nodes


class Cluster:
    def __init__(self, primaries=3, replicas=1, node_timeout_ms=1500, tls=None):
        started = time.monotonic()
        self.nodes = []
        self.tls = tls
        # redis-cli's own TLS options, for every --cluster command.
        self.cli_tls = [] if tls is None else ["--tls", "--cacert", tls["ca"]]
        self.node_timeout_ms = node_timeout_ms
        try:
            for _ in range((1 + replicas) * primaries):
                self.nodes.append(Node(node_timeout_ms, tls))  # one by one: stop() stops those started
            self.ports = [n.port for n in self.nodes]
            out = subprocess.run(
                ["redis-cli", *self.cli_tls, "--cluster", "create", *["127.0.0.1:%d" % p for p in self.ports],
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=PATIENCE)
            if out.returncode != 0 or "[OK] All 16384 slots covered" not in out.stdout:
                raise RuntimeError("redis-cli --cluster create failed (%d): %s %s"
                                   % (out.returncode, out.stdout[-3000:], out.stderr[-2000:]))
            # redis-cli makes the replicas replicate only once the nodes have met: until every node
            # knows them, the nodes can agree on a map without replicas.
            wait_until(lambda: self.agreed(replicas=replicas),
                       "every node to report cluster_state:ok and the same CLUSTER SLOTS, with %d replica(s) "
                       "for each primary" % replicas)
            # Every replica is in sync with its primary (a manual failover needs that).
            for port in self.ports:
                if self.role(port) == "slave":
                    wait_until(lambda: self.node(port).client.info("replication")["master_link_status"] == "up",
                               "the replica on port %d in sync with its primary" % port)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    # -- looking at the cluster ---------------------------------------------------------------

    def node(self, port):
        return next(n for n in self.nodes if n.port == port)

    def live(self):
        return [n for n in self.nodes if n.alive()]

    def role(self, port):
        return self.node(port).client.execute_command("ROLE")[0]

    def cluster_nodes(self, port=None):
        """CLUSTER NODES (parsed) as the node on `port` (default: the first live one) sees it."""
        n = self.node(port) if port is not None else self.live()[0]
        return parse_nodes(n.client.execute_command("CLUSTER", "NODES"))

    def node_id(self, port):
        return self.node(port).client.execute_command("CLUSTER", "MYID")

    def primaries(self):
        """Ports of the current primaries that serve slots, as the live nodes agree they are."""
        return sorted(n["port"] for n in self.cluster_nodes()
                      if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"])

    def replicas_of(self, port):
        me = self.node_id(port)
        return sorted(n["port"] for n in self.cluster_nodes()
                      if n["master"] == me and "fail" not in n["flags"])

    def slots_of(self, port):
        """Number of slots the primary on `port` serves."""
        return sum(b - a + 1 for n in self.cluster_nodes() if n["port"] == port for a, b in n["slots"])

    def slot_map(self):
        """A list of SLOTS ports: the primary serving each slot, per CLUSTER SLOTS of a live node."""
        owner = [None] * SLOTS
        for r in self.live()[0].client.execute_command("CLUSTER", "SLOTS"):
            for s in range(int(r[0]), int(r[1]) + 1):
                owner[s] = int(r[2][1])
        return owner

    def keyslot(self, key):
        return int(self.live()[0].client.execute_command("CLUSTER", "KEYSLOT", key))

    def node_for_key(self, key, slot_map=None):
        """Port of the primary owning `key`'s slot (CLUSTER KEYSLOT, then the slot map; pass
        `slot_map` to look up many keys against one map)."""
        return (slot_map or self.slot_map())[self.keyslot(key)]

    def owners(self, keys):
        """{key: port of its primary} for many keys, against one slot map."""
        m = self.slot_map()
        return {k: m[self.keyslot(k)] for k in keys}

    def client_for_key(self, key):
        """A direct (decode_responses) client of the primary owning `key`."""
        return self.node(self.node_for_key(key)).client

    def all_keys(self):
        """{port: set of keys} of every live primary, read directly."""
        return {p: set(self.node(p).client.keys("*")) for p in self.primaries()}

    def dbsize(self):
        return sum(self.node(p).client.dbsize() for p in self.primaries())

    def flushall(self):
        for p in self.primaries():
            self.node(p).client.flushall()

    def agreed(self, replicas=None):
        """True when every live node says cluster_state:ok and gives the same CLUSTER SLOTS,
        which covers all 16384 slots (and lists `replicas` replicas for each range, when given)."""
        maps = set()
        for n in self.live():
            try:
                if n.client.cluster("INFO")["cluster_state"] != "ok":
                    return False
                m = _normalized_slots(n.client.execute_command("CLUSTER", "SLOTS"))
            except redis.RedisError:
                return False
            if sum(b - a + 1 for a, b, _, _ in m) != SLOTS:
                return False
            if replicas is not None and any(len(r) != replicas for _, _, _, r in m):
                return False
            maps.add(m)
        return len(maps) == 1

    def wait_agreed(self, what="every node to report cluster_state:ok and the same CLUSTER SLOTS"):
        wait_until(self.agreed, what)

    # -- changing the cluster -----------------------------------------------------------------

    def reshard(self, from_port, to_port, slots):
        """Moves `slots` slots (and their keys) from the primary on `from_port` to the one on
        `to_port` with redis-cli --cluster reshard, then waits until every node agrees again."""
        # redis-cli refuses to reshard while the nodes disagree about the configuration.
        self.wait_agreed()
        out = subprocess.run(
            ["redis-cli", *self.cli_tls, "--cluster", "reshard", "127.0.0.1:%d" % from_port,
             "--cluster-from", self.node_id(from_port), "--cluster-to", self.node_id(to_port),
             "--cluster-slots", str(slots), "--cluster-yes"],
            capture_output=True, text=True, timeout=5 * PATIENCE)
        if out.returncode != 0 or "[ERR]" in out.stdout:
            raise RuntimeError("redis-cli --cluster reshard failed (%d): %s %s"
                               % (out.returncode, out.stdout[-3000:], out.stderr[-2000:]))
        self.wait_agreed("every node to agree on the slot map after moving %d slots from %d to %d"
                         % (slots, from_port, to_port))
        return out.stdout

    def add_primary(self):
        """Starts a seventh node and joins it with redis-cli --cluster add-node as a primary
        without slots; returns its port once every node agrees (reshard gives it slots)."""
        n = Node(self.node_timeout_ms, self.tls)
        self.nodes.append(n)
        self.ports.append(n.port)
        out = subprocess.run(
            ["redis-cli", *self.cli_tls, "--cluster", "add-node", "127.0.0.1:%d" % n.port, "127.0.0.1:%d" % self.live()[0].port],
            capture_output=True, text=True, timeout=PATIENCE)
        if out.returncode != 0 or "[OK] New node added correctly." not in out.stdout:
            raise RuntimeError("redis-cli --cluster add-node failed (%d): %s %s"
                               % (out.returncode, out.stdout[-3000:], out.stderr[-2000:]))
        wait_until(lambda: all(len(self.cluster_nodes(m.port)) == len(self.live()) for m in self.live()),
                   "every node to know the new node %d" % n.port)
        self.wait_agreed("every node, the new one too, to agree on the slot map")
        return n.port

    def failover(self, replica_port):
        """CLUSTER FAILOVER on the replica on `replica_port`; waits until it is a primary and every
        live node agrees on the slot map with cluster_state:ok."""
        assert self.node(replica_port).client.execute_command("CLUSTER", "FAILOVER") == "OK"
        wait_until(lambda: self.role(replica_port) == "master", "the replica on %d promoted" % replica_port)
        self.wait_agreed("every node to agree after the failover to %d" % replica_port)

    def kill(self, port):
        """SIGKILL of the node on `port`."""
        self.node(port).stop(signal.SIGKILL)

    def stop(self):
        for n in self.nodes:
            try:
                n.stop()
            except Exception:
                n.stop(signal.SIGKILL)
            shutil.rmtree(n.dir, ignore_errors=True)


@contextlib.contextmanager
def cluster(primaries=3, replicas=1, node_timeout_ms=1500, tls=None):
    """A started cluster whose nodes all agree; stopped afterwards."""
    c = Cluster(primaries, replicas, node_timeout_ms, tls)
    try:
        yield c
    finally:
        c.stop()


def seed_url(c):
    """keyguard's --upstream for the cluster: two seed nodes (rediss-cluster:// for a TLS one)."""
    return "%s-cluster://127.0.0.1:%d,127.0.0.1:%d" % ("redis" if c.tls is None else "rediss", c.ports[0], c.ports[1])
