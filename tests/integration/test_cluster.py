"""A Redis Cluster upstream: keyguard in front of a real six-node cluster (three primaries, a replica
each) routes every command to the node owning its keys' slots and shows its clients one node that
serves every slot. Every stored key is checked on direct connections to the nodes."""
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from cluster import SLOTS, cluster, seed_url
from conftest import ROOT, SANITIZED, Keyguard, Redis, wait_until
from resp import PATIENCE, RespConn, encode

CROSSSLOT = "CROSSSLOT Keys in request don't hash to the same slot"


def split_first(raw):
    """The first reply in `raw` (parsed), and the bytes after it."""
    c = RespConn.__new__(RespConn)
    c.sock, c.buf = None, raw
    v, _ = c.read()
    return v, c.buf


@contextlib.contextmanager
def keyguard_for(c, config=None):
    """keyguard with the cluster `c` as its upstream (two seed nodes); stopped afterwards."""
    kg = Keyguard(0, upstream=seed_url(c), config=config)
    try:
        yield kg
    except BaseException:
        kg.stop()
        raise
    assert kg.stop() == 0, kg.output()[-3000:]


@pytest.fixture(scope="module")
def shared_cluster():
    """One cluster for the tests that leave it as they found it (each empties it first)."""
    with cluster() as c:
        yield c


@pytest.fixture(scope="module")
def shared_kg(shared_cluster):
    with keyguard_for(shared_cluster) as kg:
        yield kg


@pytest.fixture
def fresh(shared_cluster, shared_kg):
    """The shared cluster emptied (directly, on every primary) and keyguard in front of it."""
    shared_cluster.flushall()
    return shared_cluster, shared_kg


def client(kg, **kw):
    """A plain (non-cluster) redis-py client of keyguard."""
    kw.setdefault("socket_timeout", 10)
    return redis.Redis(port=kg.port, decode_responses=True, **kw)


def check_stored(c, expected):
    """Every key of `expected` ({key: value}) is on the primary owning its slot, with its value,
    read directly on that node; each primary holds exactly the keys it owns (none elsewhere)."""
    owners = c.owners(expected)
    for port in c.primaries():
        mine = sorted(k for k in expected if owners[k] == port)
        node = c.node(port).client
        pipe = node.pipeline(transaction=False)
        for k in mine:
            pipe.get(k)
        got = dict(zip(mine, pipe.execute()))
        wrong = {k: (got[k], expected[k]) for k in mine if got[k] != expected[k]}
        assert not wrong, "keys on their owner %d with the wrong value (got, expected): %r" % (port, wrong)
        extra = set(node.keys("*")) - set(mine)
        assert not extra, "primary %d holds keys that other nodes own or nobody wrote: %r" % (port, sorted(extra))


def test_cluster_fixture_starts_and_agrees(shared_cluster):
    """The fixture alone, on direct connections: three primaries with a replica each, all 16384
    slots covered, and a cluster client stores each key on the node owning its slot."""
    c = shared_cluster
    print("\ncluster fixture started in %.2f s" % c.start_seconds)
    primaries = c.primaries()
    assert len(primaries) == 3
    assert all(len(c.replicas_of(p)) == 1 for p in primaries), [c.replicas_of(p) for p in primaries]
    assert sum(c.slots_of(p) for p in primaries) == SLOTS
    assert set(c.slot_map()) == set(primaries)
    assert c.agreed()
    assert c.keyslot("foo") == 12182
    c.flushall()
    rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in c.ports[:2]], decode_responses=True)
    try:
        expected = {"fx:%d" % i: "v%d" % i for i in range(100)}
        for k, v in expected.items():
            assert rc.set(k, v) is True
        assert {k: rc.get(k) for k in expected} == expected
    finally:
        rc.close()
    assert len(set(c.owners(expected).values())) == 3
    check_stored(c, expected)
    c.flushall()


def test_single_key_commands_go_to_the_owning_node(fresh):
    c, kg = fresh
    r = client(kg)
    expected = {"k:%d" % i: "value-%d" % i for i in range(200)}
    for k, v in expected.items():
        assert r.set(k, v) is True, k
    assert {k: r.get(k) for k in expected} == expected
    assert set(c.owners(expected).values()) == set(c.primaries()), "200 keys should cover every primary"
    check_stored(c, expected)
    # A hash tag puts both keys in one slot, on one node.
    assert r.set("{user:1}:a", "A") is True
    assert r.set("{user:1}:b", "B") is True
    assert c.node_for_key("{user:1}:a") == c.node_for_key("{user:1}:b")
    assert (r.get("{user:1}:a"), r.get("{user:1}:b")) == ("A", "B")
    check_stored(c, dict(expected, **{"{user:1}:a": "A", "{user:1}:b": "B"}))


def test_a_pipeline_across_nodes_keeps_its_order(fresh):
    c, kg = fresh
    p = client(kg).pipeline(transaction=False)
    for i in range(100):
        p.set("p:%d" % i, "v%d" % i)
        p.get("p:%d" % i)
    for i in range(100):
        p.get("p:%d" % (99 - i))
    replies = p.execute()
    expected_replies = [x for i in range(100) for x in (True, "v%d" % i)] + ["v%d" % (99 - i) for i in range(100)]
    assert replies == expected_replies
    expected = {"p:%d" % i: "v%d" % i for i in range(100)}
    assert len(set(c.owners(expected).values())) == 3
    check_stored(c, expected)


def test_keys_in_different_slots_are_redis_crossslot_error(fresh):
    c, kg = fresh
    r = client(kg)
    assert c.keyslot("a") != c.keyslot("b")
    # The exact error Redis itself gives (asked directly, on the node owning "a").
    with pytest.raises(redis.ResponseError) as direct:
        c.client_for_key("a").msetnx({"a": "1", "b": "2"})
    assert str(direct.value) == CROSSSLOT
    with pytest.raises(redis.ResponseError) as e:
        r.msetnx({"a": "1", "b": "2"})
    assert str(e.value) == CROSSSLOT
    assert c.dbsize() == 0, c.all_keys()
    # The connection goes on working after the error.
    assert r.get("a") is None
    # Keys in one slot (one hash tag): the multi-key commands work.
    assert r.msetnx({"{h}:a": "1", "{h}:b": "2"}) is True
    assert r.mget("{h}:a", "{h}:b") == ["1", "2"]
    assert r.delete("{h}:a", "{h}:b", "{h}:none") == 2
    assert r.mset({"{h}:x": "X", "{h}:y": "Y"}) is True
    check_stored(c, {"{h}:x": "X", "{h}:y": "Y"})


def test_keyguard_looks_like_a_one_node_cluster(fresh):
    c, kg = fresh
    conn = RespConn(kg.port)
    slots = conn.call("CLUSTER", "SLOTS")
    assert isinstance(slots, list) and len(slots) == 1, slots
    assert slots[0][:2] == [0, SLOTS - 1], slots
    assert len(slots[0]) == 3, "keyguard has no replicas to show: %r" % (slots,)
    assert slots[0][2][:2] == [b"127.0.0.1", kg.port], slots
    info = conn.call("CLUSTER", "INFO")
    assert isinstance(info, bytes) and b"cluster_state:ok" in info.split(b"\r\n"), info
    assert conn.call("CLUSTER", "KEYSLOT", "foo") == 12182
    assert conn.call("CLUSTER", "KEYSLOT", "{user:1}:a") == c.keyslot("{user:1}:a")
    conn.close()

    # A cluster client sees one node, keyguard, and sends everything there.
    rc = RedisCluster(host="127.0.0.1", port=kg.port, decode_responses=True)
    try:
        assert [(n.host, n.port) for n in rc.get_nodes()] == [("127.0.0.1", kg.port)]
        expected = {"rc:%d" % i: "v%d" % i for i in range(100)}
        for k, v in expected.items():
            assert rc.set(k, v) is True, k
        assert {k: rc.get(k) for k in expected} == expected
        check_stored(c, expected)
        # A command whose keys COMMAND cannot place (movablekeys): the client asks keyguard with
        # COMMAND GETKEYS where they are.
        assert rc.zadd("{z}:a", {"x": 1}) == 1 and rc.zadd("{z}:b", {"y": 2}) == 1
        assert rc.zunionstore("{z}:out", ["{z}:a", "{z}:b"]) == 2
        assert rc.zrange("{z}:out", 0, -1, withscores=True) == [("x", 1.0), ("y", 2.0)]
        assert rc.dbsize() == len(expected) + 3
    finally:
        rc.close()
    owner = c.node(c.node_for_key("{z}:out")).client
    assert owner.zrange("{z}:out", 0, -1, withscores=True) == [("x", 1.0), ("y", 2.0)]


def test_whole_keyspace_commands_cover_every_primary(fresh):
    c, kg = fresh
    direct = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in c.ports[:2]], decode_responses=True)
    try:
        expected = {"ks:%d" % i: str(i) for i in range(300)}
        for k, v in expected.items():
            direct.set(k, v)
    finally:
        direct.close()
    per_node = c.all_keys()
    assert all(per_node.values()) and sum(len(v) for v in per_node.values()) == 300, per_node
    r = client(kg)
    assert r.dbsize() == 300 == c.dbsize()
    keys = r.keys("*")
    assert len(keys) == 300 and set(keys) == set(expected)
    scanned = list(r.scan_iter(count=10))
    dups = sorted(k for k in set(scanned) if scanned.count(k) > 1)
    assert not dups, "SCAN returned keys more than once: %r" % dups
    assert set(scanned) == set(expected), "SCAN missed %r" % sorted(set(expected) - set(scanned))
    assert r.ping() is True
    conn = RespConn(kg.port)
    assert conn.exchange(b"*1\r\n$4\r\nPING\r\n", replies=1) == b"+PONG\r\n"
    conn.close()


def test_multi_exec_in_one_slot(fresh):
    c, kg = fresh
    p = client(kg).pipeline(transaction=True)
    p.set("{t}:a", "1")
    p.incr("{t}:b")
    p.get("{t}:a")
    p.mget("{t}:a", "{t}:b")
    assert p.execute() == [True, 1, "1", ["1", "1"]]
    owner = c.node_for_key("{t}:a")
    assert owner == c.node_for_key("{t}:b")
    assert c.all_keys()[owner] == {"{t}:a", "{t}:b"}
    check_stored(c, {"{t}:a": "1", "{t}:b": "1"})


def test_flushall_empties_every_node():
    with cluster() as c, keyguard_for(c) as kg:
        r = client(kg)
        expected = {"f:%d" % i: "v" for i in range(100)}
        for k, v in expected.items():
            assert r.set(k, v) is True
        assert c.dbsize() == 100 and all(c.all_keys().values())
        assert r.flushall() is True
        assert c.all_keys() == {p: set() for p in c.primaries()}
        # The replicas follow.
        wait_until(lambda: all(c.node(p).client.dbsize() == 0 for p in c.ports), "every node empty")
        assert r.dbsize() == 0


def reshard_behind_keyguard(c, kg, target=None):
    """Writes 2000 keys through keyguard and reads them back (keyguard knows the slot map then),
    moves 1000 slots from a primary to `target` (default: another primary) directly with
    redis-cli, and reads and writes every key through keyguard again: no error, the right
    values, every key on the node owning it now."""
    r = client(kg)
    expected = {"m:%d" % i: "v%d" % i for i in range(2000)}
    p = r.pipeline(transaction=False)
    for k, v in expected.items():
        p.set(k, v)
    assert p.execute() == [True] * len(expected)
    assert {k: r.get(k) for k in expected} == expected
    before = c.owners(expected)
    source = c.primaries()[0]
    target = target or c.primaries()[1]
    source_slots = c.slots_of(source)
    started = time.monotonic()
    c.reshard(source, target, 1000)
    print("\nresharding 1000 slots took %.2f s" % (time.monotonic() - started))
    assert c.slots_of(source) == source_slots - 1000
    after = c.owners(expected)
    moved = sorted(k for k in expected if before[k] != after[k])
    assert moved and all(before[k] == source and after[k] == target for k in moved), moved[:10]
    # First, one MGET over 12 moved keys in 12 different slots: each part is redirected on its own
    # (keyguard's map is the old one), and the client gets the values, no MOVED.
    spread = {}
    for k in moved:
        spread.setdefault(c.keyslot(k), k)
    some = list(spread.values())[:12]
    assert len(some) == 12
    assert r.mget(some) == [expected[k] for k in some]
    got = {}
    for k in moved + sorted(expected):
        try:
            got[k] = r.get(k)
        except redis.RedisError as e:
            pytest.fail("GET %s (slot %d moved from %d to %d) through keyguard: %r"
                        % (k, c.keyslot(k), before[k], after[k], e))
    assert got == expected
    check_stored(c, expected)
    # Writes of moved keys go to their new owner.
    for k in moved:
        expected[k] = "new-" + k
        assert r.set(k, expected[k]) is True, k
    check_stored(c, expected)


def test_moved_slots_are_followed_without_an_error():
    """Slots move to another primary behind keyguard's back (redis-cli, directly): keyguard's
    clients never see MOVED, reads and writes of the moved keys just work."""
    with cluster() as c, keyguard_for(c) as kg:
        reshard_behind_keyguard(c, kg)


def test_a_scan_goes_on_across_a_reshard_that_gives_another_node_the_first_slots():
    """The SCAN cursor names a node by its index among the primaries. They were in the order of
    their first slot, so a reshard that gave slot 0 to another node mid-iteration renumbered them:
    the iteration went on at the wrong node, skipping one and scanning another twice. In the order
    of their addresses, a reshard (which moves slots, not nodes) changes no index: every key that
    stays where it is is returned."""
    with cluster() as c, keyguard_for(c) as kg:
        r = client(kg)
        expected = {"sc:%d" % i: "v" for i in range(600)}
        p = r.pipeline(transaction=False)
        for k in expected:
            p.set(k, "v")
        p.execute()
        owner0 = c.slot_map()[0]
        other = next(port for port in c.primaries() if port != owner0)
        before = c.owners(expected)
        # The first node's keys, page by page, until the cursor moves to the next node.
        cursor, seen = 0, []
        while True:
            cursor, keys = r.scan(cursor, count=1000)
            seen += keys
            if cursor >> 52 != 0 or cursor == 0:
                break
        assert cursor != 0
        changes = kg.metric("keyguard_cluster_map_changes_total")
        c.reshard(owner0, other, 1000)  # `other` now has slot 0
        wait_until(lambda: kg.metric("keyguard_cluster_map_changes_total") > changes, "keyguard to take the new map")
        while cursor != 0:
            cursor, keys = r.scan(cursor, count=1000)
            seen += keys
        after = c.owners(expected)
        stayed = {k for k in expected if before[k] == after[k]}
        missed = sorted(stayed - set(seen))
        assert not missed, "%d keys that never moved were not returned, e.g. %r" % (len(missed), missed[:5])
        assert set(seen) <= set(expected)


def test_slots_moved_to_a_node_keyguard_never_saw():
    """The same with slots moving to a primary added after keyguard started (redis-cli --cluster
    add-node): keyguard learns of it from a MOVED and must follow that to a node it has no
    connection to yet."""
    with cluster() as c, keyguard_for(c) as kg:
        new = c.add_primary()
        reshard_behind_keyguard(c, kg, target=new)
        assert new in c.primaries()


def test_a_node_removed_from_the_cluster_is_let_go():
    """A primary is added, serves some slots through keyguard, gives them back and is removed
    (redis-cli --cluster del-node; it keeps running, out of the cluster): keyguard's next map no
    longer names it, so each worker retires its link (cluster_node_left) and never connects to it
    again, rather than keeping a connection to every address a node ever had; about 10 s later the
    link is freed, also when an idle client had used it (and one had been ASKed to it)."""
    with cluster(primaries=3, replicas=0) as c, keyguard_for(c) as kg:
        new = c.add_primary()
        old = [p for p in c.primaries() if p != new][0]
        c.reshard(old, new, 50)
        r = client(kg)
        # A client ASKed to the new node once (its slot moving there by hand), idle ever since.
        asked = next(k for k in ("asked:%d" % i for i in range(20000)) if c.node_for_key(k) == old)
        aslot = c.keyslot(asked)
        assert r.set(asked, "a") is True
        begin_migration(c, aslot, old, new, asked)
        asks = kg.metric('keyguard_cluster_redirects_total{kind="ask"}')
        idle = RespConn(kg.port)
        assert idle.exchange(encode("GET", asked), replies=1) == b"$1\r\na\r\n"
        assert kg.metric('keyguard_cluster_redirects_total{kind="ask"}') == asks + 1
        set_slot_owner(c, aslot, new)
        keys = [k for k in ("gone:%d" % i for i in range(20000)) if c.node_for_key(k) == new][:20]
        for k in keys:
            assert r.set(k, "v") is True  # through MOVED: keyguard links to the new node
        assert kg.metric('keyguard_cluster_node_commands_total{node="127.0.0.1:%d"}' % new) >= 20
        for k in keys + [asked]:
            r.delete(k)
        c.reshard(new, old, 51)
        node = c.node(new)
        out = subprocess.run(["redis-cli", "--cluster", "del-node", "127.0.0.1:%d" % old, c.node_id(new)],
                             capture_output=True, text=True, timeout=PATIENCE)
        assert out.returncode == 0, out.stdout + out.stderr
        try:
            def others():  # connections on the removed node but this one
                return [l for l in node.client.client_list() if l["cmd"] != "client|list"]
            wait_until(lambda: not others(), "keyguard to close its connections to the removed node")
            assert any(l.get("event") == "cluster_node_left" and l.get("node") == "127.0.0.1:%d" % new
                       for l in kg.log_lines())
            # The closed links are kept a while for retries that may still name them, and by every
            # client that used them: `r` has sent nothing since, and an idle client kept them for
            # as long as it stayed connected. The worker sweeps its clients and frees them.
            assert kg.metric("keyguard_cluster_retired_links") >= 1
            time.sleep(2.5)  # longer than a link's longest reconnect pause
            assert others() == []
            wait_until(lambda: kg.metric("keyguard_cluster_retired_links") == 0,
                       "keyguard to free the departed node's links", timeout=max(PATIENCE, 30))
        finally:
            node.stop()
            idle.close()
        # The rest of the cluster is served as before.
        for i in range(50):
            assert r.set("after:%d" % i, "x") is True
        assert sum(c.node(p).client.dbsize() for p in c.primaries()) == 50


def run_load(kg, threads, stop, acked, errors, tags):
    """`threads` threads, each a plain client of keyguard writing unique keys (every other one in
    the slot of one of `tags`, the rest anywhere) and reading each back at once, until `stop` is
    set; acknowledged SETs go in `acked` ({key: value}), anything a client saw go wrong in `errors`
    (time, what). Returns the threads."""
    def worker(t):
        r = client(kg)
        n = 0
        while not stop.is_set():
            n += 1
            k = "%s:load:%d:%d" % (tags[n % len(tags)], t, n) if n % 2 else "load:%d:%d" % (t, n)
            v = "v%d.%d" % (t, n)
            try:
                if r.set(k, v) is not True:
                    errors.append((time.monotonic(), "SET %s did not answer OK" % k))
                    continue
                acked[k] = v
                got = r.get(k)
                if got != v:
                    errors.append((time.monotonic(), "GET %s right after its SET: %r, not %r" % (k, got, v)))
            except redis.RedisError as e:
                errors.append((time.monotonic(), "%s: %r" % (k, e)))
                time.sleep(0.01)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    return ts


def test_resharding_under_load_loses_nothing():
    """Three clients write and read through keyguard while 1000 slots (with their keys) move from
    one primary to another: no client sees an error, and every acknowledged write is readable,
    through keyguard and directly on the node now owning it. Half the writes go to 20 of the
    moving slots, each filled with 500 keys first, so that the slots take a while to migrate and
    the writes meet them half-way (ASK redirections)."""
    with cluster() as c, keyguard_for(c) as kg:
        source, target = c.primaries()[:2]
        slot_map = c.slot_map()
        # redis-cli --cluster reshard moves the source's lowest slots.
        moving = set(sorted(s for s in range(SLOTS) if slot_map[s] == source)[:1000])
        tags = [t for t in ("{r%d}" % i for i in range(2000)) if c.keyslot(t) in moving][:20]
        assert len(tags) == 20
        prefill = {"%s:pre:%d" % (t, j): "p%d" % j for t in tags for j in range(500)}
        p = c.node(source).client.pipeline(transaction=False)
        for k, v in prefill.items():
            p.set(k, v)
        assert p.execute() == [True] * len(prefill)

        acked, errors, stop = {}, [], threading.Event()
        threads = run_load(kg, 3, stop, acked, errors, tags)
        try:
            wait_until(lambda: len(acked) >= 1500, "writes through keyguard")
            source_slots = c.slots_of(source)
            started, n_before = time.monotonic(), len(acked)
            c.reshard(source, target, 1000)
            took, during = time.monotonic() - started, len(acked) - n_before
            n_after = len(acked)
            wait_until(lambda: len(acked) >= n_after + 300, "writes after the resharding")
        finally:
            stop.set()
            for t in threads:
                t.join()
        print("\nresharding 1000 slots under load took %.2f s; %d writes acknowledged during it, %d in all"
              % (took, during, len(acked)))
        assert c.slots_of(source) == source_slots - 1000
        assert all(c.node_for_key(t) == target for t in tags), "the slots of %r did not move" % tags
        assert not errors, "%d errors seen by clients, the first ones: %r" % (len(errors), errors[:10])
        r = client(kg)
        expected = dict(prefill, **acked)
        keys = sorted(expected)
        p = r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        got = dict(zip(keys, p.execute()))
        wrong = {k: got[k] for k in keys if got[k] != expected[k]}
        assert not wrong, "%d acknowledged writes read back wrong through keyguard: %r" % (
            len(wrong), sorted(wrong.items())[:10])
        check_stored(c, expected)


class WriteLoad:
    """Two plain clients of keyguard writing unique keys in the slots of `tags` (all owned by one
    primary) until stopped: the acknowledged writes (time, key, value) and the failed ones (time,
    what) are recorded."""

    def __init__(self, kg, tags):
        self.acked, self.failures, self.stop_event, self.lock = [], [], threading.Event(), threading.Lock()
        self.kg, self.tags = kg, tags
        self.threads = [threading.Thread(target=self.writer, args=(t,)) for t in range(2)]
        for t in self.threads:
            t.start()

    def writer(self, t):
        r = client(self.kg, socket_timeout=5)
        n = 0
        while not self.stop_event.is_set():
            n += 1
            k, v = "%s:%d:%d" % (self.tags[(n + t) % len(self.tags)], t, n), "v%d" % n
            try:
                ok = r.set(k, v)
                if ok is not True:
                    raise AssertionError("SET %s answered %r" % (k, ok))
                with self.lock:
                    self.acked.append((time.monotonic(), k, v))
            except (redis.RedisError, AssertionError) as e:
                self.failures.append((time.monotonic(), "%s: %r" % (k, e)))
                time.sleep(0.01)

    def acked_after(self, when):
        return [(ts, k, v) for ts, k, v in list(self.acked) if ts > when]

    def wait_acked_after(self, when, n, what):
        try:
            wait_until(lambda: len(self.acked_after(when)) >= n, what)
        except AssertionError as e:
            raise AssertionError("%s; %d failed writes, the last ones: %r" % (e, len(self.failures), self.failures[-5:]))

    def check_no_redirection(self, old, new):
        """A write may fail while the slots have no primary, but never with a redirection (MOVED,
        ASK): keyguard follows those."""
        shown = [f for f in self.failures if "MOVED" in f[1] or "ASK" in f[1]]
        assert not shown, "%d writes failed with a redirection keyguard should have followed (old primary %d, " \
            "new primary %d): %r" % (len(shown), old, new, shown[:5])

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join()

    def window(self, started, switched):
        """Prints and returns (the window in which writes failed: from the first failed write to
        the first one acknowledged after the last failure, 0 when none failed; the longest time
        between two acknowledged writes, which is what clients waited when writes were held
        rather than failed)."""
        window = 0.0
        if self.failures:
            window = min(ts for ts, _, _ in self.acked if ts > self.failures[-1][0]) - self.failures[0][0]
        times = [ts for ts, _, _ in self.acked]
        gap = max(b - a for a, b in zip(times, times[1:]))
        print("\nfailover window: %.2f s (%d failed writes; longest time without an acknowledged write %.2f s; "
              "promoted %.2f s after the start)%s"
              % (window, len(self.failures), gap, switched - started,
                 "; first failure %.2f s after the start: %s" % (self.failures[0][0] - started, self.failures[0][1])
                 if self.failures else ""))
        return window, gap


def tags_owned_by(c, port, n=4):
    """`n` hash tags whose slots the primary on `port` owns."""
    slot_map = c.slot_map()
    tags = [t for t in ("{fo%d}" % i for i in range(500)) if c.node_for_key(t, slot_map) == port][:n]
    assert len(tags) == n
    return tags


def check_on(c, port, writes):
    """Every (time, key, value) of `writes` is on the node on `port`, read directly."""
    node = c.node(port).client
    p = node.pipeline(transaction=False)
    for _, k, _ in writes:
        p.get(k)
    got = p.execute()
    missing = [(k, g, v) for (_, k, v), g in zip(writes, got) if g != v]
    assert not missing, "%d acknowledged writes are not on the primary %d (key, there, acknowledged): %r" % (
        len(missing), port, missing[:10])


def fail_over_under_load(c, kg, old, switch):
    """A write load through keyguard on keys `old` owns; `switch()` takes `old` away and its
    replica is promoted. Returns (load, replica, started, switched) once writes are acknowledged
    after the switch; checks that no redirection reached a client, that the window in which
    writes failed and the longest gap without an acknowledged write are under 10 s, that the
    replica owns the keys and that every write acknowledged after the switch is on it."""
    replica = c.replicas_of(old)[0]
    tags = tags_owned_by(c, old)
    load = WriteLoad(kg, tags)
    try:
        load.wait_acked_after(0, 300, "writes through keyguard")
        started = time.monotonic()
        switch()
        wait_until(lambda: c.role(replica) == "master", "the replica on %d promoted" % replica)
        switched = time.monotonic()
        c.wait_agreed()
        load.wait_acked_after(switched, 300, "writes acknowledged after the failover")
    finally:
        load.stop()
    window, gap = load.window(started, switched)
    load.check_no_redirection(old, replica)
    assert window < 10, "writes failed for %.2f s: %r" % (window, load.failures[:10])
    assert gap < 10, "no write was acknowledged for %.2f s" % gap
    assert old not in c.primaries() and replica in c.primaries(), (old, replica, c.primaries())
    assert all(c.node_for_key(t) == replica for t in tags)
    check_on(c, replica, load.acked_after(switched))
    return load, replica


def test_failover_under_write_load():
    """CLUSTER FAILOVER on the replica of the primary owning the keys being written through
    keyguard: the window in which writes fail is measured (and printed), and every write
    acknowledged after the switch is on the new primary."""
    with cluster() as c, keyguard_for(c) as kg:
        old = c.primaries()[0]
        replica = c.replicas_of(old)[0]

        def manual_failover():
            assert c.node(replica).client.execute_command("CLUSTER", "FAILOVER") == "OK"
        load, _ = fail_over_under_load(c, kg, old, manual_failover)
        # A manual failover loses nothing: the replica caught up before it took over.
        check_on(c, replica, load.acked)


def test_killed_primary_under_write_load():
    """kill -9 of a primary (keyguard's first seed node) owning the keys being written through
    keyguard: its replica takes over after the node timeout; the window in which writes fail is
    measured (and printed), and every write acknowledged after the switch is on the new primary."""
    with cluster() as c, keyguard_for(c) as kg:
        old = c.ports[0]
        assert old in c.primaries(), "redis-cli made the first node a replica"
        fail_over_under_load(c, kg, old, lambda: c.kill(old))


def encode_reply(items):
    """A RESP2 array of bulk strings and integers, as the server sends pub/sub frames."""
    out = b"*%d\r\n" % len(items)
    for i in items:
        if isinstance(i, int):
            out += b":%d\r\n" % i
        else:
            out += b"$%d\r\n%s\r\n" % (len(i), i.encode())
    return out


def keys_on_distinct_nodes(c, n=3, prefix="k"):
    """`n` key names, each owned by a different primary (in the order of c.primaries())."""
    found = {}
    i = 0
    while len(found) < n:
        key = "%s%d" % (prefix, i)
        found.setdefault(c.node_for_key(key), key)
        i += 1
    return list(found.values())


def test_multi_key_commands_across_slots_are_split_and_merged(fresh):
    c, kg = fresh
    r = client(kg)
    refused = kg.metric('keyguard_commands_rejected_total{reason="cluster"}')
    a, b, d = keys_on_distinct_nodes(c)
    assert r.mset({a: "1", b: "2", d: "3", "{%s}x" % a: "4"}) is True
    check_stored(c, {a: "1", b: "2", d: "3", "{%s}x" % a: "4"})
    # MGET: the values in the client's order, nil in place of a missing key, duplicates kept.
    assert r.mget(d, "missing", a, b, a, "{%s}x" % a) == ["3", None, "1", "2", "1", "4"]
    assert r.exists(a, b, d, "missing", a) == 4
    assert r.touch(a, b, "missing") == 2
    assert r.delete(a, d, "missing") == 2
    assert r.unlink(b, "{%s}x" % a) == 2
    check_stored(c, {})
    # Not split: Redis's own error, nothing stored.
    with pytest.raises(redis.ResponseError, match=CROSSSLOT):
        r.execute_command("SUNIONSTORE", a, b, d)
    with pytest.raises(redis.ResponseError, match=CROSSSLOT):
        r.rename(a, b)
    check_stored(c, {})
    assert kg.metric('keyguard_commands_rejected_total{reason="cluster"}') == refused + 2


def test_a_transaction_across_nodes_aborts_and_says_why(fresh):
    c, kg = fresh
    r = client(kg)
    a, b, _ = keys_on_distinct_nodes(c)
    conn = RespConn(kg.port)
    out = conn.exchange(b"*1\r\n$5\r\nMULTI\r\n" + encode("SET", a, "1") + encode("SET", b, "2") + b"*1\r\n$4\r\nEXEC\r\n",
                        replies=4)
    assert out.startswith(b"+OK\r\n+QUEUED\r\n-ERR keyguard: slot %d is on another cluster node" % c.keyslot(b))
    assert out.endswith(b"-EXECABORT Transaction discarded because of previous errors.\r\n")
    check_stored(c, {})
    # The connection is back on the shared links afterwards: both keys work.
    assert conn.exchange(encode("SET", a, "x") + encode("SET", b, "y"), replies=2) == b"+OK\r\n+OK\r\n"
    check_stored(c, {a: "x", b: "y"})
    # WATCH on one node, then a transaction there.
    with r.pipeline(transaction=True) as p:
        p.watch(a)
        assert p.get(a) == "x"
        p.multi()
        p.set(a, "z")
        assert p.execute() == [True]
    assert r.get(a) == "z"


def test_a_multi_sent_alone_goes_to_the_node_of_the_first_keyed_command(fresh):
    """A client that waits for MULTI's +OK before it sends the transaction's commands (redis-cli,
    Jedis) gets its transaction on the node of its first keyed command, as a pipelined one does:
    keyguard answers the MULTI and sends it with the command that pins the client."""
    c, kg = fresh
    pins = kg.metric('keyguard_upstream_pins_total{reason="transaction"}')
    conn = RespConn(kg.port)
    keys = keys_on_distinct_nodes(c)  # one on each primary
    for n, key in enumerate(keys):
        assert conn.exchange(encode("MULTI"), replies=1) == b"+OK\r\n"
        assert conn.exchange(encode("SET", key, "v%d" % n), replies=1) == b"+QUEUED\r\n"
        assert conn.exchange(encode("INCR", "{%s}:n" % key), replies=1) == b"+QUEUED\r\n"  # the same slot
        assert conn.exchange(encode("EXEC"), replies=1) == b"*2\r\n+OK\r\n:1\r\n"
    check_stored(c, dict([(k, "v%d" % n) for n, k in enumerate(keys)] + [("{%s}:n" % k, "1") for k in keys]))
    # An empty transaction, a discarded one, and a keyless command first: as Redis answers them.
    assert conn.exchange(encode("MULTI"), replies=1) == b"+OK\r\n"
    assert conn.exchange(encode("EXEC"), replies=1) == b"*0\r\n"
    assert conn.exchange(encode("MULTI"), replies=1) == b"+OK\r\n"
    assert conn.exchange(encode("DISCARD"), replies=1) == b"+OK\r\n"
    assert conn.exchange(encode("EXEC"), replies=1) == b"-ERR EXEC without MULTI\r\n"
    assert conn.exchange(encode("MULTI"), replies=1) == b"+OK\r\n"
    assert conn.exchange(encode("MULTI"), replies=1) == b"-ERR MULTI calls can not be nested\r\n"
    assert conn.exchange(encode("PING") + encode("EXEC"), replies=2) == b"+QUEUED\r\n*1\r\n+PONG\r\n"
    # MULTI with an argument is the server's arity error, and starts nothing.
    assert conn.exchange(encode("MULTI", "x"), replies=1) == b"-ERR wrong number of arguments for 'multi' command\r\n"
    assert conn.exchange(encode("SET", keys[1], "w"), replies=1) == b"+OK\r\n"
    assert conn.exchange(encode("EXEC"), replies=1) == b"-ERR EXEC without MULTI\r\n"
    assert conn.exchange(encode("MULTI") + encode("QUIT"), replies=2, closed=True) == b"+OK\r\n+OK\r\n<closed>"
    conn.close()
    # One pin per transaction a command joined (not the empty or discarded ones, nor QUIT's), and
    # one for `MULTI x`, which goes to the server as it is.
    assert kg.metric('keyguard_upstream_pins_total{reason="transaction"}') == pins + 5


def one_at_a_time(conn, *steps):
    """Each (command, reply) of `steps` sent alone, its exact reply read before the next is sent
    (as redis-cli and Jedis send a transaction)."""
    for args, want in steps:
        got = conn.exchange(encode(*args), replies=1)
        assert got == want, (args, got)


def test_keyless_commands_first_in_a_transaction_sent_alone_wait_for_its_node(fresh):
    """A client that waits for each +QUEUED (redis-cli, Jedis) and starts its transaction with a
    keyless command: the transaction was pinned to the first primary, and its keys on the other
    nodes were refused (EXEC aborted). keyguard answers +QUEUED for the keyless commands and sends
    them right after the MULTI, on the node of the first keyed command."""
    c, kg = fresh
    pins = kg.metric('keyguard_upstream_pins_total{reason="transaction"}')
    conn = RespConn(kg.port)
    keys = keys_on_distinct_nodes(c)
    ok, queued = b"+OK\r\n", b"+QUEUED\r\n"
    for n, key in enumerate(keys):
        one_at_a_time(conn, (["MULTI"], ok), (["PING"], queued), (["ECHO", "e%d" % n], queued),
                      (["SET", key, "v%d" % n], queued), (["TIME"], queued), (["GET", key], queued))
        got = conn.exchange(encode("EXEC"), replies=1)  # (TIME: the node's own, pinned by then)
        assert got.startswith(b"*5\r\n+PONG\r\n$2\r\ne%d\r\n+OK\r\n*2\r\n" % n), got
        assert got.endswith(b"$2\r\nv%d\r\n" % n), got
    check_stored(c, {k: "v%d" % n for n, k in enumerate(keys)})
    one_at_a_time(
        conn,
        # Keyless only, each sent alone: one node runs it.
        (["MULTI"], ok), (["PING", "a"], queued), (["ECHO", "b"], queued),
        (["EXEC"], b"*2\r\n$1\r\na\r\n$1\r\nb\r\n"),
        # Discarded: nothing was sent, nothing pinned.
        (["MULTI"], ok), (["PING"], queued), (["DISCARD"], ok), (["EXEC"], b"-ERR EXEC without MULTI\r\n"),
        # A keyless command the server refuses as it queues, an unknown subcommand, one of a
        # wrong count or one not allowed in a transaction (no_multi), is not held: the client
        # sees the server's error (it saw +QUEUED, found by helper-43), and EXEC aborts, as it
        # would have.
        (["MULTI"], ok), (["CONFIG", "NOSUCH"], b"-ERR unknown subcommand 'NOSUCH'. Try CONFIG HELP.\r\n"),
        (["OBJECT", "ENCODING"], b"-ERR wrong number of arguments for 'object|encoding' command\r\n"),
        (["SAVE"], b"-ERR Command not allowed inside a transaction\r\n"),
        (["EXEC"], b"-EXECABORT Transaction discarded because of previous errors.\r\n"),
        # A keyless command keyguard refuses while queued, alone: EXEC aborts, nothing pinned
        # (EXEC answered *0, an empty success, found by helper-42).
        (["MULTI"], ok),
        (["CLUSTER", "INFO"],
         b"-ERR keyguard: CLUSTER INFO is not served inside MULTI through keyguard (ask outside the transaction)\r\n"),
        (["EXEC"], b"-EXECABORT Transaction discarded because of previous errors.\r\n"))
    assert c.node(c.node_for_key(keys[1])).client.get(keys[1]) == "v1"
    # Past 64 KB of keyless commands the transaction pins at once, to the first primary (keyguard
    # keeps no more of a client's bytes): a key of another node is then refused.
    big = "x" * 70000
    one_at_a_time(conn, (["MULTI"], ok), (["ECHO", big], queued))
    refused = conn.exchange(encode("SET", keys[1], "w"), replies=1)
    assert refused.startswith(b"-ERR keyguard: "), refused
    one_at_a_time(conn, (["EXEC"], b"-EXECABORT Transaction discarded because of previous errors.\r\n"))
    # The client's next commands go where their keys are.
    one_at_a_time(conn, *[(["GET", key], b"$2\r\nv%d\r\n" % n) for n, key in enumerate(keys)])
    conn.close()
    # One pin per transaction that ran or was sent: three keyed, one keyless, one aborted, the big one.
    assert kg.metric('keyguard_upstream_pins_total{reason="transaction"}') == pins + 6


def test_resp3_clients_reach_every_node(fresh):
    """A RESP3 client (HELLO 3: Lettuce and go-redis v9 by default) was pinned to one node, and
    its commands for other nodes' slots were refused. Now it moves to each node's RESP3 shared
    connections: its commands reach every primary, and every reply is RESP3, merged ones and
    keyguard's own included (MGET's nulls, CLUSTER INFO's verbatim text, CLUSTER SHARDS' maps,
    CLIENT GETNAME's null); HELLO 2 moves it back."""
    c, kg = fresh
    keys = keys_on_distinct_nodes(c)
    conn = RespConn(kg.port)
    hello = conn.exchange(encode("HELLO", "3"), replies=1)
    assert hello.startswith(b"%7\r\n$6\r\nserver\r\n") and b"$5\r\nproto\r\n:3\r\n" in hello
    for n, key in enumerate(keys):
        assert conn.exchange(encode("HSET", key, "f", str(n)) + encode("HGETALL", key), replies=2) == (
            b":1\r\n%%1\r\n$1\r\nf\r\n$1\r\n%d\r\n" % n)
    pipeline = b"".join(encode("SET", "s:%d" % i, "v%d" % i) for i in range(30))
    assert conn.exchange(pipeline, replies=30) == b"+OK\r\n" * 30
    mget = ["s:%d" % i for i in range(30)] + ["missing"]
    assert conn.exchange(encode("MGET", *mget), replies=1) == (
        b"*31\r\n" + b"".join(b"$%d\r\nv%d\r\n" % (len(str(i)) + 1, i) for i in range(30)) + b"_\r\n")
    assert conn.exchange(encode("DBSIZE"), replies=1) == b":33\r\n"
    assert conn.exchange(encode("GET", "missing") + encode("CLIENT", "GETNAME"), replies=2) == b"_\r\n_\r\n"
    info = conn.exchange(encode("CLUSTER", "INFO"), replies=1)
    assert info.startswith(b"=") and b"\r\ntxt:cluster_enabled:1\r\n" in info
    shards = conn.exchange(encode("CLUSTER", "SHARDS"), replies=1)
    assert shards.startswith(b"*1\r\n%2\r\n$5\r\nslots\r\n") and b"*1\r\n%6\r\n$2\r\nid\r\n" in shards
    assert kg.metric('keyguard_upstream_pins_total{reason="hello"}') == 0
    # A transaction on the node of its key: keyguard's HELLO 3 went first on the pinned connection.
    assert conn.exchange(encode("MULTI") + encode("HGETALL", keys[2]) + encode("EXEC"), replies=3) == (
        b"+OK\r\n+QUEUED\r\n*1\r\n%1\r\n$1\r\nf\r\n$1\r\n2\r\n")
    assert conn.exchange(encode("HELLO", "2"), replies=1).startswith(b"*14\r\n")
    assert conn.exchange(encode("HGETALL", keys[1]) + encode("MGET", "missing", keys[0] + "x"), replies=2) == (
        b"*2\r\n$1\r\nf\r\n$1\r\n1\r\n*2\r\n$-1\r\n$-1\r\n")
    assert conn.exchange(encode("DEL", *keys), replies=1) == b":3\r\n"
    conn.close()
    check_stored(c, dict(("s:%d" % i, "v%d" % i) for i in range(30)))


def test_a_new_map_keeps_the_resp3_connections():
    """A new slot map (a slot moved) retired every RESP3 shared connection that owed nothing at
    that moment, and logged its node as gone: RESP3 clients' next commands waited for connects.
    The RESP3 links of nodes that are still primaries stay."""
    with cluster() as c, keyguard_for(c) as kg:
        conn = RespConn(kg.port)
        assert conn.exchange(encode("HELLO", "3") + encode("DBSIZE"), replies=2).endswith(b":0\r\n")

        def resp3_ids():
            return {p: sorted(x["id"] for x in c.node(p).client.client_list() if x.get("resp") == "3")
                    for p in c.primaries()}

        before = resp3_ids()
        assert all(before.values()), before
        changes = kg.metric("keyguard_cluster_map_changes_total")
        primaries = c.primaries()
        c.reshard(primaries[0], primaries[1], 1)
        wait_until(lambda: kg.metric("keyguard_cluster_map_changes_total") > changes, "keyguard to take the new map")
        assert conn.exchange(encode("DBSIZE"), replies=1) == b":0\r\n"
        assert resp3_ids() == before
        assert kg.events("cluster_node_left") == []
        conn.close()


def test_a_resp3_move_that_fails_leaves_a_cluster_client_as_it_was(tmp_path):
    """A cluster whose nodes refuse HELLO (renamed here; a server without RESP3): a client's HELLO 3
    gets why, at once, and the client stays on RESP2, keyguard's own answers included. (It was
    switched anyway: every command waited for RESP3 connections that never came, then failed.)"""
    node = Redis("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"),
                 "--rename-command", "HELLO", "")
    direct = redis.Redis(port=node.port, decode_responses=True)
    try:
        direct.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
    except redis.ResponseError:
        pass  # (KEYGUARD_UPSTREAM=cluster: the fixture assigned them)

    def ok():
        info = direct.execute_command("CLUSTER", "INFO")  # a dict (redis-py parses it) or the text
        return info.get("cluster_state") == "ok" if isinstance(info, dict) else "cluster_state:ok" in info

    wait_until(ok, "the one-node cluster")
    kg = Keyguard(0, upstream="redis-cluster://127.0.0.1:%d" % node.port)
    try:
        conn = RespConn(kg.port)
        started = time.monotonic()
        assert conn.exchange(encode("HELLO", "3"), replies=1) == (
            b"-ERR keyguard: upstream refused HELLO 3: ERR unknown command 'HELLO', with args beginning with: '3' \r\n")
        assert time.monotonic() - started < 2
        assert conn.exchange(encode("SET", "a", "v") + encode("GET", "a") + encode("GET", "missing") +
                             encode("CLIENT", "GETNAME"), replies=4) == b"+OK\r\n$1\r\nv\r\n$-1\r\n$-1\r\n"
        assert conn.exchange(encode("CLUSTER", "INFO"), replies=1).startswith(b"$")
        conn.close()
    finally:
        assert kg.stop() == 0
        node.stop()


def test_the_size_probe_asks_each_keys_node(fresh):
    """The sizing probe (hygiene.probe) was off with a cluster: it had one connection, to the
    upstream. It now asks each key's own node: a big hash on every primary, read with HGET (whose
    reply does not show its size), is a big_key_access finding with its exact size."""
    c, kg = fresh
    keys = keys_on_distinct_nodes(c, prefix="feed:")
    for n, key in enumerate(keys):
        c.client_for_key(key).hset(key, mapping={"f%d" % i: i for i in range(5001 + n)})
    probed = kg.metric("keyguard_probed_keys_total")
    r = client(kg)
    for key in keys:
        assert r.hget(key, "f7") == "7"

    def found():
        status, body = kg.http("/debug/findings")
        assert status == 200
        return {f["key"]: f["elements"] for f in json.loads(body)["findings"]
                if f["kind"] == "big_key_access" and f["key"] in keys}

    assert wait_until(lambda: len(found()) == 3 and found(), "a finding for each node's key") == {
        key: 5001 + n for n, key in enumerate(keys)}
    assert kg.metric("keyguard_probed_keys_total") - probed == 3
    c.flushall()


def test_a_stopped_node_does_not_stop_the_size_probe_for_the_others():
    """The probe asks each node in turn: a node that holds its connection and answers nothing
    (stopped here) held the probe, and no key of any other node was sized again. Each round trip
    now ends within upstream_connect_timeout_ms."""
    with cluster(primaries=3, replicas=0, node_timeout_ms=60000) as c:
        kg = Keyguard(0, upstream=seed_url(c), threads=1, config="upstream_connect_timeout_ms: 500\n")
        stopped = None
        try:
            keys = keys_on_distinct_nodes(c, prefix="feed:")
            for k in keys + ["{%s}2" % keys[1]]:
                c.client_for_key(k).hset(k, mapping={"f%d" % i: i for i in range(5001)})
            r = client(kg)

            def found():
                return {f["key"] for f in json.loads(kg.http("/debug/findings")[1])["findings"]
                        if f["kind"] == "big_key_access"}

            assert r.hget(keys[1], "f7") == "7"
            wait_until(lambda: keys[1] in found(), "the first node's key sized")
            stopped = c.node(c.node_for_key(keys[1]))
            os.kill(stopped.proc.pid, signal.SIGSTOP)
            # A command on the stopped node queues its key for the probe (the command itself waits).
            waiting = RespConn(kg.port)
            waiting.send("HGET", "{%s}2" % keys[1], "f7")
            time.sleep(0.2)
            assert r.hget(keys[2], "f7") == "7"
            wait_until(lambda: keys[2] in found(), "another node's key sized while one node is stopped")
        finally:
            if stopped is not None:
                os.kill(stopped.proc.pid, signal.SIGCONT)
            kg.stop()


def test_a_tenants_key_walks_cover_every_primary(shared_cluster):
    """A tenant's DBSIZE, RANDOMKEY and FLUSHDB walk its keys on every primary in turn, and touch
    no one else's."""
    c = shared_cluster
    c.flushall()
    config = open(os.path.join(ROOT, "examples", "tenants.yaml")).read()
    with keyguard_for(c, config=config) as kg:
        alice = redis.Redis(port=kg.port, username="alice", password="alice-secret", decode_responses=True)
        others = {"tenant:b:%d" % i: "b" for i in range(30)}
        others.update({"plain:%d" % i: "p" for i in range(30)})
        direct = RedisCluster(host="127.0.0.1", port=c.ports[0], decode_responses=True)
        for k, v in others.items():
            direct.set(k, v)
        assert alice.dbsize() == 0 and alice.randomkey() is None
        mine = ["k%d" % i for i in range(200)]
        for k in mine:
            assert alice.set(k, "a") is True
        per_node = c.all_keys()
        assert all(any(k.startswith("tenant:a:") for k in keys) for keys in per_node.values()), per_node
        assert alice.dbsize() == 200
        assert alice.randomkey() in set(mine)
        assert alice.flushdb() is True
        assert alice.dbsize() == 0
        check_stored(c, others)
        direct.close()
        # On a connection pinned to one node a walk would see that node only: refused.
        conn = RespConn(kg.port)
        assert conn.exchange(encode("AUTH", "alice", "alice-secret") + encode("WATCH", "k1") + encode("DBSIZE") +
                             encode("UNWATCH"), replies=4) == (
            b"+OK\r\n+OK\r\n-ERR keyguard: a tenant's DBSIZE, FLUSHDB, FLUSHALL and RANDOMKEY are not served on a "
            b"connection pinned to one cluster node (in a transaction, after HELLO, SUBSCRIBE, ...)\r\n+OK\r\n")
        assert conn.exchange(encode("DBSIZE"), replies=1) == b":0\r\n"  # back on the shared links
        conn.close()


def test_a_tenants_keys_scan_and_split_commands_stay_its_own_on_every_primary(shared_cluster):
    """KEYS and SCAN fan out over the primaries and MSET/MGET/EXISTS/DEL split by slot: on three
    primaries, a tenant sees its own keys of every node (without the prefix) and nothing of
    another tenant's keys of the same names, and its split deletes touch only its own."""
    c = shared_cluster
    c.flushall()
    config = open(os.path.join(ROOT, "examples", "tenants.yaml")).read()
    with keyguard_for(c, config=config) as kg:
        alice = redis.Redis(port=kg.port, username="alice", password="alice-secret", decode_responses=True)
        bob = redis.Redis(port=kg.port, username="bob", password="bob-secret", decode_responses=True)
        names = ["k%d" % i for i in range(60)]
        assert alice.mset({k: "a" for k in names}) is True
        assert bob.mset({k: "b" for k in names}) is True
        assert all(any(k.startswith("tenant:a:") for k in keys) for keys in c.all_keys().values())
        assert sorted(alice.keys("*")) == sorted(names)
        assert sorted(alice.keys("k1*")) == sorted(k for k in names if k.startswith("k1"))
        assert sorted(alice.scan_iter(count=7)) == sorted(names)
        assert sorted(bob.scan_iter(match="k2*")) == sorted(k for k in names if k.startswith("k2"))
        assert alice.mget(names) == ["a"] * 60 and bob.mget(names) == ["b"] * 60
        assert alice.exists(*names) == 60
        assert alice.delete(*names[:30]) == 30
        assert alice.exists(*names) == 30 and bob.exists(*names) == 60
        assert sorted(bob.keys("*")) == sorted(names)
        stored = set().union(*c.all_keys().values())
        assert stored == {"tenant:a:%s" % k for k in names[30:]} | {"tenant:b:%s" % k for k in names}
        # A tenant may name its own connection in a TRACKING REDIRECT, but client ids are counted
        # per node: its connection's id on one node is another connection's on the node the
        # REDIRECT runs on (maybe another tenant's). Refused, pinning nothing.
        mine, sink = RespConn(kg.port), RespConn(kg.port)
        for conn in (mine, sink):
            assert conn.call("AUTH", "alice", "alice-secret") == "OK"
        sink_id = sink.call("CLIENT", "ID")
        pins = kg.metric('keyguard_upstream_pins_total{reason="client"}')
        assert mine.exchange(encode("CLIENT", "TRACKING", "ON", "REDIRECT", sink_id) + encode("GET", "k40"),
                             replies=2) == (
            b"-ERR keyguard: CLIENT TRACKING REDIRECT is not served through a Redis Cluster upstream (a client id "
            b"names one node's connection); use RESP3 tracking (HELLO 3, then CLIENT TRACKING ON)\r\n$1\r\na\r\n")
        assert kg.metric('keyguard_upstream_pins_total{reason="client"}') == pins
        mine.close()
        sink.close()
        alice.close()
        bob.close()


def test_blocking_pops_and_shard_channels_go_to_the_owning_node(fresh):
    c, kg = fresh
    r = client(kg)
    a, b, _ = keys_on_distinct_nodes(c, prefix="q")
    # A blocking pop on each node, woken by another client through keyguard.
    results = {}

    def pop(key):
        results[key] = client(kg).blpop([key], timeout=10)
    threads = [threading.Thread(target=pop, args=(k,)) for k in (a, b)]
    for t in threads:
        t.start()
    wait_until(lambda: all(c.node(p).client.info("clients")["blocked_clients"] == 1
                           for p in (c.node_for_key(a), c.node_for_key(b))), "both pops blocked on their nodes")
    assert r.rpush(a, "va") == 1 and r.rpush(b, "vb") == 1
    for t in threads:
        t.join(10)
    assert results == {a: (a, "va"), b: (b, "vb")}
    # SSUBSCRIBE and SPUBLISH by the channel's slot; SUBSCRIBE/PUBLISH through any node.
    sub = RespConn(kg.port)
    assert sub.exchange(encode("SSUBSCRIBE", a), replies=1) == encode_reply(["ssubscribe", a, 1])
    assert r.execute_command("SPUBLISH", a, "hi") == 1
    assert sub.exchange(b"", replies=1) == encode_reply(["smessage", a, "hi"])
    assert c.node(c.node_for_key(a)).client.execute_command("PUBSUB", "SHARDNUMSUB", a)[1] == 1
    sub2 = RespConn(kg.port)
    assert sub2.exchange(encode("SUBSCRIBE", "news"), replies=1) == encode_reply(["subscribe", "news", 1])
    # (PUBLISH counts the receivers on the node that took it; the message crosses the cluster bus.)
    r.publish("news", "m")
    assert sub2.exchange(b"", replies=1) == encode_reply(["message", "news", "m"])


def test_keyguard_answers_what_one_node_cannot_carry_for_many(fresh):
    c, kg = fresh
    r = client(kg)
    assert r.client_setname("app-1") is True
    assert r.client_getname() == "app-1"
    assert r.execute_command("READONLY") is True
    with pytest.raises(redis.ResponseError, match="CLUSTER FAILOVER is not served through keyguard"):
        r.execute_command("CLUSTER", "FAILOVER")
    assert r.execute_command("CLUSTER", "MYID") == r.execute_command("CLUSTER", "MYID")
    # Nobody was pinned for them.
    assert kg.metric('keyguard_upstream_pins_total{reason="client"}') == 0
    # Commands by node: every primary got some.
    for i in range(30):
        r.set("n%d" % i, i)
    for port in c.primaries():
        assert kg.metric('keyguard_cluster_node_commands_total{node="127.0.0.1:%d"}' % port) > 0
    assert kg.metric("keyguard_cluster_primaries") == 3
    assert kg.metric('keyguard_cluster_node_errors_total{node="127.0.0.1:%d"}' % c.primaries()[0]) == 0


def test_readyz_wants_every_slot_served(fresh):
    c, kg = fresh
    assert kg.http("/readyz") == (200, "ready\n")
    owner = c.slot_map()[0]
    try:
        for node in c.live():
            node.client.execute_command("CLUSTER", "DELSLOTS", "0")
        # keyguard sees it at its next look at the map (every 5 s).
        wait_until(lambda: kg.http("/readyz") == (503, "upstream %s: 1 slots have no primary\n" % seed_url(c)),
                   "/readyz to say a slot is unserved", timeout=15)
    finally:
        c.node(owner).client.execute_command("CLUSTER", "ADDSLOTS", "0")
        c.wait_agreed()
    wait_until(lambda: kg.http("/readyz") == (200, "ready\n"), "/readyz ready again", timeout=15)


def test_audit_walks_every_primary_and_resumes_across_them(fresh):
    import json
    import subprocess
    from conftest import KEYGUARD
    c, kg = fresh
    r = client(kg)
    keys = {"user:%d:profile" % i: "x" for i in range(300)}
    r.mset(keys)
    check_stored(c, keys)

    def audit(*extra):
        p = subprocess.run([KEYGUARD, "audit", "--upstream", seed_url(c), "--format", "json", "--no-progress", *extra],
                           capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout), p.stderr

    whole, _ = audit()
    assert (whole["scanned"], whole["dbsize"], whole["complete"]) == (300, 300, True)
    # Stopped part-way (on the first primary, it holds about a third), resumed where it stopped.
    first, err = audit("--max-keys", "50", "--count", "20")
    assert not first["complete"]
    cursor = err.strip().rsplit("--cursor ", 1)[1]
    rest, _ = audit("--cursor", cursor)
    assert rest["complete"] and first["scanned"] + rest["scanned"] == 300
    # The cursor names its primaries: one of other primaries (after a failover) is refused.
    stale = subprocess.run([KEYGUARD, "audit", "--upstream", seed_url(c), "--no-progress", "--cursor",
                            cursor.split("-")[0] + "-00000000"], capture_output=True, text=True, timeout=60)
    assert stale.returncode == 2 and "the cluster's primaries changed since this cursor was printed" in stale.stderr


def test_a_tls_cluster_through_rediss_cluster(tmp_path):
    """Every node serves TLS only (clients, bus, replication); keyguard reaches them with
    rediss-cluster:// and verifies their certificate, its clients talk plain TCP to it."""
    from test_tls import make_ca, make_cert
    d = str(tmp_path)
    make_ca(d, "ca")
    make_cert(d, "node", "ca", "localhost", "DNS:localhost,IP:127.0.0.1")
    tls = {"cert": d + "/node.crt", "key": d + "/node.key", "ca": d + "/ca.crt"}
    with cluster(primaries=3, replicas=0, tls=tls) as c:
        kg = Keyguard(0, upstream=seed_url(c), config="upstream_tls:\n  ca_file: %s\n" % tls["ca"])
        try:
            r = client(kg)
            keys = {"tls:%d" % i: str(i) for i in range(60)}
            for k, v in keys.items():
                assert r.set(k, v) is True
            assert r.mget(list(keys)) == list(keys.values())
            check_stored(c, keys)
            assert r.dbsize() == 60
            assert kg.metric('keyguard_upstream_errors_total{reason="tls"}') == 0
            assert kg.http("/readyz") == (200, "ready\n")
        finally:
            assert kg.stop() == 0, kg.output()[-3000:]
        # A CA that did not sign the nodes' certificate: keyguard does not start, and says why.
        import subprocess
        from conftest import KEYGUARD, free_port
        make_ca(d, "other")
        with open(d + "/other.yaml", "w") as f:
            f.write("upstream_tls:\n  ca_file: %s/other.crt\n" % d)
        p = subprocess.run([KEYGUARD, "--config", d + "/other.yaml", "--upstream", seed_url(c), "--listen",
                            "127.0.0.1:%d" % free_port(), "--admin", "127.0.0.1:%d" % free_port()],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode != 0
        assert "no cluster node gave a slot map" in p.stderr + p.stdout and "TLS" in p.stderr + p.stdout, \
            p.stderr + p.stdout
        # keyguard audit walks the same nodes over TLS, with the same settings; and says why not with
        # the other CA, naming each seed.
        import json
        with open(d + "/ca.yaml", "w") as f:
            f.write("upstream_tls:\n  ca_file: %s\n" % tls["ca"])
        audit = [KEYGUARD, "audit", "--upstream", seed_url(c), "--format", "json", "--no-progress", "--config"]
        p = subprocess.run(audit + [d + "/ca.yaml"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        j = json.loads(p.stdout)
        assert (j["scanned"], j["dbsize"], j["complete"], j["patterns"][0]["keys"]) == (60, 60, True, 60)
        p = subprocess.run(audit + [d + "/other.yaml"], capture_output=True, text=True, timeout=60)
        why = "TLS: certificate verify failed: self-signed certificate in certificate chain"
        assert (p.returncode, p.stderr) == (2, "keyguard audit: upstream %s: 127.0.0.1:%d: %s; 127.0.0.1:%d: %s\n" % (
            seed_url(c), c.ports[0], why, c.ports[1], why))


def test_reads_from_replicas_when_asked(fresh):
    """cluster.read_from: replica_preferred sends read-only commands to a replica of the slot's
    primary (READONLY on keyguard's connections to it); writes stay on the primaries."""
    c, _ = fresh
    kg = Keyguard(0, upstream=seed_url(c), config="cluster:\n  read_from: replica_preferred\n")
    try:
        r = client(kg)
        keys = {"ro:%d" % i: str(i) for i in range(90)}
        r.mset(keys)
        check_stored(c, keys)
        replicas = [p for q in c.primaries() for p in c.replicas_of(q)]
        wait_until(lambda: sum(c.node(p).client.dbsize() for p in replicas) == 90, "the replicas to have every key")
        for n in c.live():
            n.client.config_resetstat()

        def gets(port):
            return c.node(port).client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
        # The replica links come up in the background: reads go to the primaries until then.
        wait_until(lambda: [r.get(k) for k in keys] == list(keys.values()) and sum(gets(p) for p in replicas) > 0,
                   "reads served by the replicas")
        for p in c.primaries():
            c.node(p).client.config_resetstat()
        for p in replicas:
            c.node(p).client.config_resetstat()
        assert [r.get(k) for k in keys] == list(keys.values())
        assert sum(gets(p) for p in replicas) == 90
        assert sum(gets(p) for p in c.primaries()) == 0
        assert r.set("ro:0", "written") is True  # a write goes to the primary
        assert c.client_for_key("ro:0").get("ro:0") == "written"
    finally:
        assert kg.stop() == 0, kg.output()[-3000:]


def test_publish_keeps_a_clients_order_and_wait_is_refused(fresh):
    c, kg = fresh
    r = client(kg)
    sub = RespConn(kg.port)
    assert sub.exchange(encode("SUBSCRIBE", "ordered"), replies=1) == encode_reply(["subscribe", "ordered", 1])
    p = r.pipeline(transaction=False)
    for i in range(200):
        p.publish("ordered", str(i))
    assert p.execute() == [1] * 200  # the node of the subscription counts it, every time
    got = b"".join(sub.read()[1] for _ in range(200))
    assert got == b"".join(encode_reply(["message", "ordered", str(i)]) for i in range(200))
    assert r.execute_command("PUBSUB", "NUMSUB", "ordered") == ["ordered", 1]
    # WAIT cannot know this client's writes (they went over shared connections to several nodes).
    with pytest.raises(redis.ResponseError, match="WAIT cannot tell about this client's writes"):
        r.execute_command("WAIT", "1", "100")
    assert kg.metric('keyguard_upstream_pins_total{reason="blocking"}') >= 0


def move_slot(c, slot, to):
    """Migrates one slot to the primary on `to` by hand (IMPORTING/MIGRATING, MIGRATE of its keys,
    then SETSLOT NODE everywhere): the steps redis-cli --cluster reshard takes for each slot."""
    owner = c.slot_map()[slot]
    source = c.node(owner).client
    begin_migration(c, slot, owner, to)
    while True:
        keys = source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        if not keys:
            break
        source.execute_command("MIGRATE", "127.0.0.1", to, "", 0, 5000, "KEYS", *keys)
    set_slot_owner(c, slot, to)


def test_a_pipeline_keeps_its_order_while_its_slot_moves(fresh):
    """One connection pipelines SET k i, RPUSH {k}l i and MGET k zz {k}zz (split over two slots)
    (i = 0..N-1) while the slot of k moves to another primary (MOVED and ASK on the way): every
    command runs once, in the client's order, so the list is 0..N-1, k holds N-1, and each MGET
    reads the SET before it or a later one. (The MGET's parts were sent without waiting for an
    earlier command of their slot being redirected: a part overtook the SET it follows and read
    an older value.)"""
    c, kg = fresh
    key = "ro"
    slot = c.keyslot(key)
    n = 20000
    for round_ in range(2):
        r = client(kg)
        r.delete(key, "{ro}l")
        target = [p for p in c.primaries() if p != c.slot_map()[slot]][round_ % 2]
        conn = RespConn(kg.port, timeout=60)
        data = b"".join(encode("SET", key, str(i)) + encode("RPUSH", "{ro}l", str(i)) +
                        encode("MGET", key, "zz", "{ro}zz") for i in range(n))
        mover = threading.Thread(target=lambda: (time.sleep(0.01), move_slot(c, slot, target)))
        mover.start()
        conn.sock.sendall(data)
        replies = [conn.read()[1] for _ in range(3 * n)]
        mover.join()
        assert replies[0::3] == [b"+OK\r\n"] * n
        assert replies[1::3] == [b":%d\r\n" % (i + 1) for i in range(n)]
        # Each MGET reads the SET before it, or (a part the migrating node answered TRYAGAIN, as
        # it does a multi-key command whose keys are not all there: sent again after the SETs the
        # server ran meanwhile, as a cluster client's would be) a later one; never an older one.
        values = [split_first(m)[0] for m in replies[2::3]]
        older = [(i, v) for i, v in enumerate(values)
                 if not isinstance(v, list) or v[1:] != [None, None] or int(v[0]) < i or int(v[0]) >= n]
        assert not older, "%d MGETs read a value older than the SET before them, e.g. %r" % (len(older), older[:3])
        assert r.get(key) == str(n - 1)
        assert r.lrange("{ro}l", 0, -1) == [str(i) for i in range(n)]
        assert c.slot_map()[slot] == target


def set_slot_owner(c, slot, to):
    """CLUSTER SETSLOT NODE on every primary, in the order Redis's documentation gives: the node
    importing the slot first (else, for a moment, the source sends its clients to a target that
    still sends them back)."""
    target_id = c.node_id(to)
    for p in sorted(c.primaries(), key=lambda p: p != to):
        c.node(p).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def slot_owner_and_other(c, key):
    """The slot of `key`, the primary that owns it, and another primary."""
    slot = c.keyslot(key)
    owner = c.slot_map()[slot]
    return slot, owner, [p for p in c.primaries() if p != owner][0]


def begin_migration(c, slot, owner, to, *keys):
    """Starts moving `slot` from the primary on `owner` to the one on `to` (IMPORTING on `to`,
    MIGRATING on `owner`) and MIGRATEs `keys` there; set_slot_owner ends it."""
    c.node(to).client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", c.node_id(owner))
    c.node(owner).client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", c.node_id(to))
    if keys:
        c.node(owner).client.execute_command("MIGRATE", "127.0.0.1", to, "", 0, 5000, "KEYS", *keys)


def test_a_multi_key_command_waits_out_a_slot_migration(fresh):
    """While a slot migrates, a multi-key command whose keys are not all on one side goes round:
    the owner ASKs it to the importing node, which answers TRYAGAIN, and the retry goes to the
    owner again. Each ASK of that cycle counted as a redirect: after 5 (one slot) or 10 (a part
    of a split command) the next redirection reached the client (a MOVED in CI). Now the cycle is
    bounded by the tries (about 2 s): the command is answered once the slot has moved. Each
    command is the first of its slot on its own connection, so both go round: the one-slot one
    and the split one's part."""
    c, kg = fresh
    r = client(kg)
    key = "ro"
    slot = c.keyslot(key)
    assert r.set(key, "v") is True
    owner = c.slot_map()[slot]
    to = [p for p in c.primaries() if p != owner][0]
    asks = kg.metric('keyguard_cluster_redirects_total{kind="ask"}')
    begin_migration(c, slot, owner, to, key)
    one, split = RespConn(kg.port), RespConn(kg.port)
    try:
        # "ro" and "{ro}zz": neither node has both; the split one adds "zz", of another slot.
        one.sock.sendall(encode("MGET", key, "{ro}zz"))
        split.sock.sendall(encode("MGET", key, "zz", "{ro}zz"))
        # Past 10 cycles each (10 ms more of pause each time: 0.55 s), the slot moves; replies to
        # both before that (a redirection each that ran out of tries) end the wait at once.
        wait_until(lambda: kg.metric('keyguard_cluster_redirects_total{kind="ask"}') >= asks + 24 or
                   len(select.select([one.sock, split.sock], [], [], 0)[0]) == 2,
                   "keyguard to go round the migration")
    finally:
        set_slot_owner(c, slot, to)
    assert one.read()[1] == b"*2\r\n$1\r\nv\r\n$-1\r\n"
    assert split.read()[1] == b"*3\r\n$1\r\nv\r\n$-1\r\n$-1\r\n"
    assert r.get(key) == "v"
    one.close()
    split.close()


def test_a_split_commands_part_is_retried_on_its_own_node_not_where_another_part_was_asked(fresh):
    """MGET kb ka, each key on its own node, while both slots are being imported by a third node:
    ka has moved there already, kb has not. kb's node is reconnecting (its links killed, the node
    asleep), so kb's part waits for it; ka's part is ASKed to the importing node. The ASK target
    was kept per command, not per part, so kb's part was retried there with ASKING, and the
    importing node answered for a key it does not have: nil, where kb holds "vb"."""
    c, kg = fresh
    ka, kb = keys_on_distinct_nodes(c, n=2, prefix="ask")
    x, z = c.node_for_key(ka), c.node_for_key(kb)
    y = [p for p in c.primaries() if p not in (x, z)][0]
    sa, sb = c.keyslot(ka), c.keyslot(kb)
    r = client(kg)
    assert r.set(ka, "va") is True and r.set(kb, "vb") is True
    conn = RespConn(kg.port)
    assert conn.exchange(encode("HELLO", "3"), replies=1).startswith(b"%")
    assert conn.exchange(encode("MGET", kb, ka), replies=1) == b"*2\r\n$2\r\nvb\r\n$2\r\nva\r\n"
    begin_migration(c, sa, x, y, ka)
    begin_migration(c, sb, z, y)
    sleeper = RespConn(z)
    try:
        # keyguard's links to z die, and z answers nothing for a second: its new links wait.
        sleeper.sock.sendall(encode("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") +
                             encode("DEBUG", "SLEEP", "1"))
        time.sleep(0.2)
        assert conn.exchange(encode("MGET", kb, ka), replies=1) == b"*2\r\n$2\r\nvb\r\n$2\r\nva\r\n"
        assert sleeper.read()[1].startswith(b":") and sleeper.read()[1] == b"+OK\r\n"
    finally:
        set_slot_owner(c, sa, y)
        for n in (y, z):
            c.node(n).client.execute_command("CLUSTER", "SETSLOT", sb, "STABLE")
        sleeper.close()
        conn.close()
    assert r.mget(kb, ka) == ["vb", "va"]


def test_nodes_that_send_a_command_back_and_forth_are_waited_for(fresh):
    """A SETSLOT NODE done on the slot's old owner before the new one: for a moment each names the
    other (MOVED to the new owner, which answers MOVED back). keyguard followed each MOVED at
    once and ran out of redirects in a few round trips, and the client got -MOVED; now a MOVED
    after a MOVED waits like a TRYAGAIN (10 ms more each time, about 2 s in all), and the
    commands are answered once the new owner has its SETSLOT (here 100 ms later). A one-slot
    command and a split one's part, each on its own connection."""
    c, kg = fresh
    r = client(kg)
    key = "pp"
    slot, owner, to = slot_owner_and_other(c, key)
    assert c.keyslot("zz") != slot
    assert r.set(key, "v") is True and r.set("zz", "w") is True
    moved = kg.metric('keyguard_cluster_redirects_total{kind="moved"}')
    begin_migration(c, slot, owner, to, key)
    one, split = RespConn(kg.port), RespConn(kg.port)
    try:
        # The owner first (the wrong order): it sends the slot's commands to `to`, which sends
        # them back while it still only imports the slot.
        c.node(owner).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(to))
        one.sock.sendall(encode("GET", key))
        split.sock.sendall(encode("MGET", "zz", key))
        wait_until(lambda: kg.metric('keyguard_cluster_redirects_total{kind="moved"}') >= moved + 6,
                   "keyguard to be sent back and forth")
        time.sleep(0.1)
    finally:
        set_slot_owner(c, slot, to)
    assert one.read()[1] == b"$1\r\nv\r\n"
    assert split.read()[1] == b"*2\r\n$1\r\nw\r\n$1\r\nv\r\n"
    assert r.get(key) == "v"
    one.close()
    split.close()


def test_nodes_that_never_agree_cost_a_pipeline_one_wait(fresh):
    """The same back and forth, but the new owner's SETSLOT never comes (the tool moving the slot
    died in between): the first command waits out its pauses (about 2 s) and gets the -MOVED;
    the 4 pipelined behind it, of the same slot, are not each given 2 s more (10 s in all), but
    fail as fast as the redirections go. A later disagreement is waited out again."""
    c, kg = fresh
    r = client(kg)
    key = "nv"
    slot, owner, to = slot_owner_and_other(c, key)
    assert r.set(key, "v") is True
    begin_migration(c, slot, owner, to, key)
    conn = RespConn(kg.port, timeout=60)
    try:
        c.node(owner).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(to))
        start = time.monotonic()
        replies = conn.exchange(b"".join(encode("GET", key) for _ in range(5)) + encode("PING"), replies=6)
        took = time.monotonic() - start
    finally:
        set_slot_owner(c, slot, to)
    assert replies.count(b"-MOVED %d 127.0.0.1:" % slot) == 5 and replies.endswith(b"+PONG\r\n")
    assert 1.5 < took < 6, took
    assert r.get(key) == "v"
    # Later, on the same connection (whose last replies for the slot were those -MOVEDs), a brief
    # disagreement is waited out again: the old window, long over, does not count against it.
    time.sleep(max(0.0, 4.5 - (time.monotonic() - start)))
    begin_migration(c, slot, to, owner, key)
    try:
        c.node(to).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(owner))
        conn.sock.sendall(encode("GET", key))
        time.sleep(0.1)
    finally:
        set_slot_owner(c, slot, owner)
    assert conn.read()[1] == b"$1\r\nv\r\n"
    conn.close()


FORGE = "return redis.error_reply(ARGV[1])"  # a script's error: whatever text it is given


def test_a_scripts_redirection_to_an_address_the_cluster_never_named_is_not_followed(fresh):
    """A script answers any error text: EVAL "return redis.error_reply('MOVED <slot> host:port')"
    with a key of that slot. keyguard took it for the node's redirection: the slot went to that
    address for every client of the worker, and keyguard connected there with its upstream
    credentials. Now nothing is sent to an address the map does not have as a primary: the map is
    asked for again (a node may have just joined), the command waits for it a few times (a
    script's, about 0.2 s) and goes where the map says, and the error, still there, is the
    client's reply."""
    c, kg = fresh
    r = client(kg)
    key = "fk"
    slot = c.keyslot(key)
    assert r.set(key, "v") is True
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    forged = "MOVED %d 127.0.0.1:%d" % (slot, trap.getsockname()[1])
    conn = RespConn(kg.port, timeout=30)
    try:
        start = time.monotonic()
        assert conn.exchange(encode("EVAL", FORGE, 1, key, forged), replies=1) == b"-%s\r\n" % forged.encode()
        assert 0.2 < time.monotonic() - start < 1.5
        assert conn.exchange(encode("GET", key), replies=1) == b"$1\r\nv\r\n"
        assert r.get(key) == "v"
        trap.settimeout(0.5)
        with pytest.raises(socket.timeout):
            trap.accept()  # (the old binary: keyguard's connection, with AUTH or HELLO)
    finally:
        trap.close()
        conn.close()


def test_a_scripts_redirection_for_another_slot_is_its_reply(fresh):
    """A node redirects a command for the slot of its keys. A "MOVED" naming another slot (here a
    real primary's, one that does not own it) is a script's: passed on at once, and the map is
    not changed by it (keyguard followed it, ran the script again there, and sent the other
    slot's commands to the wrong primary until it redirected them back)."""
    c, kg = fresh
    r = client(kg)
    key, other = "fk", "zz"
    slot, _, _ = slot_owner_and_other(c, key)
    other_slot, _, elsewhere = slot_owner_and_other(c, other)
    assert other_slot != slot
    assert r.set(other, "w") is True
    forged = "MOVED %d 127.0.0.1:%d" % (other_slot, elsewhere)
    moved = kg.metric('keyguard_cluster_redirects_total{kind="moved"}')
    conn = RespConn(kg.port)
    start = time.monotonic()
    assert conn.exchange(encode("EVAL", FORGE, 1, key, forged), replies=1) == b"-%s\r\n" % forged.encode()
    assert time.monotonic() - start < 1.0
    assert conn.exchange(encode("GET", other), replies=1) == b"$1\r\nw\r\n"
    assert kg.metric('keyguard_cluster_redirects_total{kind="moved"}') == moved
    conn.close()


@pytest.mark.parametrize("pinned", [False, True], ids=["shared", "pinned"])
def test_a_scripts_redirection_to_another_primary_moves_no_slot(fresh, pinned):
    """A script's MOVED for its key's slot, naming a real primary that does not own it: keyguard
    took it as the node's word and moved the slot for every client of the worker (each of their
    commands of that slot went to the wrong primary and was redirected back; a transaction or
    blocking command pinned meanwhile went to the wrong node). On a shared connection a script's
    MOVED is now followed for that command alone (there the node answers its own MOVED back: two
    nodes naming each other, waited out as when a slot changes hands, a script's 6 times, about
    0.2 s, and the last MOVED is the reply); on a pinned one (where a MOVED is the client's own)
    it only has the map asked for again. Neither changes the map: the next command of the slot goes to its owner,
    with no redirection."""
    c, kg = fresh
    r = client(kg)
    key = "fk"
    slot, _, other = slot_owner_and_other(c, key)
    assert r.set(key, "v") is True
    forged = "MOVED %d 127.0.0.1:%d" % (slot, other)
    conn = RespConn(kg.port)
    start = time.monotonic()
    if pinned:
        assert conn.exchange(encode("WATCH", key) + encode("EVAL", FORGE, 1, key, forged) + encode("UNWATCH"),
                             replies=3) == b"+OK\r\n-%s\r\n+OK\r\n" % forged.encode()
    else:
        assert conn.exchange(encode("EVAL", FORGE, 1, key, forged), replies=1).startswith(b"-MOVED %d 127.0.0.1:" % slot)
    assert time.monotonic() - start < 1.5
    moved = kg.metric('keyguard_cluster_redirects_total{kind="moved"}')
    assert r.get(key) == "v"
    assert kg.metric('keyguard_cluster_redirects_total{kind="moved"}') == moved
    conn.close()


def test_an_ask_to_a_primary_just_added_is_followed():
    """A slot's first import to a primary just added (redis-cli --cluster add-node, then the
    reshard's first slot): its owner ASKs for the keys already moved to a node that serves no slot
    yet, which CLUSTER SLOTS does not name. keyguard's map has it from CLUSTER SHARDS, so the ASK
    is followed (a target outside the map waits for the map, 2 s, and then reached the client);
    apart from the primaries, so a tenant's walks (DBSIZE, KEYS) still go to the nodes with slots
    only (with it among them, every walk failed: "the cluster changed during the walk")."""
    config = open(os.path.join(ROOT, "examples", "tenants.yaml")).read()
    with cluster(replicas=0) as c, keyguard_for(c, config=config) as kg:
        alice = redis.Redis(port=kg.port, username="alice", password="alice-secret", decode_responses=True,
                            socket_timeout=10)
        key = "ak"
        slot, owner, _ = slot_owner_and_other(c, "tenant:a:" + key)
        assert alice.set(key, "v") is True and alice.set("other", "w") is True
        changes = kg.metric("keyguard_cluster_map_changes_total")
        new = c.add_primary()
        wait_until(lambda: kg.metric("keyguard_cluster_map_changes_total") > changes,
                   "keyguard's map to have the node added")
        assert alice.dbsize() == 2 and sorted(alice.keys("*")) == ["ak", "other"]
        begin_migration(c, slot, owner, new, "tenant:a:" + key)
        try:
            start = time.monotonic()
            assert alice.get(key) == "v"
            assert time.monotonic() - start < 1.5
        finally:
            c.node(new).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(new))
            set_slot_owner(c, slot, new)
        assert alice.get(key) == "v" and alice.get("other") == "w"
        wait_until(lambda: alice.dbsize() == 2, "the walk to count the key on the node now serving its slot")


def test_split_commands_on_a_node_still_connecting_are_answered():
    """Two pipelined split commands with a part each on a node whose link was still connecting
    (a RESP3 client's first commands there): with the first cut of the split commands' order,
    the second part waited behind the first and nothing ever sent it, so the client got one reply
    and then nothing."""
    with cluster(primaries=3, replicas=0) as c, keyguard_for(c) as kg:
        keys = keys_on_distinct_nodes(c)
        conn = RespConn(kg.port)
        assert conn.exchange(encode("HELLO", "3"), replies=1).startswith(b"%")
        data = b"".join(encode("MGET", "{%s}%s" % (t, x), "{%s}%s" % (keys[0], y))
                        for t in (keys[1], keys[2]) for x, y in (("a", "b"), ("c", "d")))
        assert conn.exchange(data + encode("PING"), replies=5) == b"*2\r\n_\r\n_\r\n" * 4 + b"+PONG\r\n"
        # The same over RESP2 right after keyguard's connections to a node were killed.
        r2 = RespConn(kg.port)
        for _ in range(5):
            c.node(c.node_for_key(keys[1])).client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            assert r2.exchange(encode("DEL", "{%s}a" % keys[1], "{%s}b" % keys[0]) +
                               encode("DEL", "{%s}c" % keys[1], "{%s}d" % keys[0]), replies=2) == b":0\r\n:0\r\n"
        conn.close()
        r2.close()


def test_a_cluster_that_announces_hostnames():
    """Nodes announced by name (cluster-announce-hostname, cluster-preferred-endpoint-type
    hostname: CLUSTER SLOTS and MOVED name "localhost"): keyguard resolves the names and routes."""
    with cluster(primaries=3, replicas=0) as c:
        for n in c.live():
            n.client.config_set("cluster-announce-hostname", "localhost")
            n.client.config_set("cluster-preferred-endpoint-type", "hostname")
        wait_until(lambda: all(r[2][0] == "localhost" for r in c.live()[0].client.execute_command("CLUSTER", "SLOTS")),
                   "CLUSTER SLOTS to name the nodes by hostname")
        with keyguard_for(c) as kg:
            r = client(kg)
            keys = {"host:%d" % i: str(i) for i in range(60)}
            assert r.mset(keys) is True
            assert r.mget(list(keys)) == list(keys.values())
            check_stored(c, keys)
            assert kg.http("/readyz") == (200, "ready\n")


def test_a_pinned_command_after_its_slot_moved(fresh):
    """A blocking command pins to the node keyguard's map names. When the slot moved behind
    keyguard's back, that node answers MOVED on the client's own connection (passed on, as a
    cluster node would); keyguard corrects its map from it, so the client's next try is served."""
    c, kg = fresh
    r = client(kg)
    slot = c.keyslot("bq")
    assert r.rpush("bq", "x") == 1
    target = [p for p in c.primaries() if p != c.slot_map()[slot]][0]
    move_slot(c, slot, target)
    first = None
    try:
        first = r.blpop(["bq"], timeout=1)
    except redis.ResponseError as e:
        assert str(e).startswith("MOVED %d " % slot), e
    assert (first or r.blpop(["bq"], timeout=1)) == ("bq", "x")


def test_replies_held_behind_a_slow_node_are_bounded(fresh):
    """A node that answers late (DEBUG SLEEP) holds the client's later replies from the other
    nodes in keyguard until their turn; a client piling up more than 16 times
    limits.max_output_buffer of them is cut off, and keyguard's memory stays bounded."""
    c, _ = fresh
    kg = Keyguard(0, upstream=seed_url(c), config="limits:\n  max_output_buffer: 65536\n")
    try:
        r = client(kg)
        slow, fast, _ = keys_on_distinct_nodes(c, prefix="hol")
        assert r.set(fast, "x" * 100000) is True
        rss_before = kg.rss_kb()
        conn = RespConn(kg.port, timeout=30)
        sleeper = threading.Thread(target=lambda: c.client_for_key(slow).execute_command("DEBUG", "SLEEP", "1"))
        sleeper.start()
        time.sleep(0.1)
        # GET of the slow node's key first, then 400 GETs of a 100 kB value on another node.
        conn.sock.sendall(encode("GET", slow) + encode("GET", fast) * 400)
        sleeper.join()
        assert conn.exchange(b"", closed=True).endswith(b"<closed>")
        wait_until(lambda: kg.events("slow_client_closed"), "keyguard to cut the client off")
        if not SANITIZED:  # (ASan keeps freed memory in quarantine)
            assert kg.rss_kb() - rss_before < 30000, "keyguard kept %d kB" % (kg.rss_kb() - rss_before)
        assert r.get(fast) == "x" * 100000  # everyone else is served
    finally:
        assert kg.stop() == 0, kg.output()[-3000:]


def test_a_hung_primary_fails_its_commands_once_the_cluster_fails_it_over():
    """A primary stops answering (SIGSTOP: no RST, as in a partition) with a client's command in
    flight on it and later commands of that client answered by other nodes. Once the cluster has
    promoted its replica and keyguard has the new map, the command in flight gets an error and
    the others their replies; a new command for the slot is served by the promoted replica."""
    import signal
    with cluster() as c, keyguard_for(c) as kg:
        r = client(kg)
        a, b, d = keys_on_distinct_nodes(c, prefix="hung")
        assert r.mset({a: "A", b: "B", d: "D"}) is True
        stopped = c.node(c.node_for_key(a))
        conn = RespConn(kg.port, timeout=30)
        stopped.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            out = conn.exchange(encode("GET", a) + encode("GET", b) + encode("GET", d), replies=3)
            waited = time.monotonic() - started
            print("\nthe client's replies came %.1f s after its primary stopped" % waited)
            assert out.startswith(b"-ERR keyguard: cluster node 127.0.0.1:%d unavailable\r\n" % stopped.port), out
            assert out.endswith(b"$1\r\nB\r\n$1\r\nD\r\n")
            assert waited < 20
            wait_until(lambda: r.get(a) == "A", "the promoted replica to serve the slot", timeout=20)
        finally:
            stopped.proc.send_signal(signal.SIGCONT)


MIGRATE_CONFIG = r"""
migrations:
  - {name: profiles, match: 'User_*_Profile', pattern: '^User_(\d+)_Profile$', rewrite: 'user:$1:profile',
     reshape: json_to_hash, nested: separate_key, batch: 7, max_ops_per_second: 0}
  - {name: profiles-flat, match: 'User_*_Profile', pattern: '^User_(\d+)_Profile$', rewrite: 'user:$1:profile',
     reshape: json_to_hash, batch: 50, max_ops_per_second: 0}
  - {name: renames, match: 'Old-*', pattern: '^Old-(.+)$', rewrite: 'new:$1', batch: 5, max_ops_per_second: 0}
  - {name: slow, match: 'Slow_*', pattern: '^Slow_(\d+)$', rewrite: 'slow:$1', reshape: json_to_hash, batch: 1,
     max_ops_per_second: 4}
  - {name: slow-now, match: 'Slow_*', pattern: '^Slow_(\d+)$', rewrite: 'slow:$1', reshape: json_to_hash,
     max_ops_per_second: 0}
"""


def cluster_migrate(c, config, name, step, *args, check=0):
    from conftest import KEYGUARD
    p = subprocess.run([KEYGUARD, "migrate", "--config", config, "--upstream", seed_url(c), "--migration", name,
                        step, "--no-progress", *args], capture_output=True, text=True, timeout=600)
    if check is not None:
        assert p.returncode == check, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.strip().splitlines() if " scanned=" in l]
    p.summary = dict(kv.split("=", 1) for kv in line[-1].split() if "=" in kv) if line else {}
    return p


def all_keys(c):
    """Every key on every primary, read directly: {key: port}."""
    return {k: p for p in c.primaries() for k in c.node(p).client.keys("*")}


@pytest.fixture
def migrate_config(tmp_path):
    path = tmp_path / "migrate.yaml"
    path.write_text(MIGRATE_CONFIG)
    return str(path)


def test_migrate_walks_every_primary_and_moves_keys_between_nodes(fresh, migrate_config):
    """keyguard migrate with a cluster upstream: each primary's old keys, their new keys written on
    the nodes owning the new names (most in another slot), compared by content (a Hash of 600
    fields, a Set, a sorted set: DUMP's bytes differ between nodes for those), expiries kept, and
    cleanup deleting only old keys whose new keys match. The same steps for a hash-tagged pair in
    one slot go through the single atomic script."""
    c, kg = fresh
    direct = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in c.ports[:2]], decode_responses=True)
    try:
        profiles = {}
        for i in range(40):
            doc = {"name": "u%d" % i, "age": i, "address": {"city": "c%d" % i, "zip": "%05d" % i}, "tags": ["a", str(i)]}
            profiles[i] = doc
            direct.set("User_%d_Profile" % i, json.dumps(doc), px=100000000 if i % 4 == 0 else None)
        direct.hset("Old-big", mapping={"f%d" % i: "v%d" % i for i in range(600)})
        direct.pexpire("Old-big", 50000000)
        direct.sadd("Old-set", *["m%d" % i for i in range(300)])
        direct.zadd("Old-z", {"z%d" % i: i / 3 for i in range(200)})
        direct.rpush("Old-list", *["l%d" % i for i in range(50)])
        direct.set("Old-str", "text", px=70000000)
        direct.set("Old-{t}x", "tagged")  # new:{t}x: the same slot, the atomic script
        old_expiry = {k: direct.execute_command("PEXPIRETIME", k) for k in ["Old-big", "Old-str"]}
        owners = c.owners(["User_%d_Profile" % i for i in range(40)] + ["user:%d:profile" % i for i in range(40)])
        assert sum(owners["User_%d_Profile" % i] != owners["user:%d:profile" % i] for i in range(40)) >= 15
        before = all_keys(c)
        assert len(set(before.values())) == 3, "the old keys are spread over the 3 primaries"

        dry = cluster_migrate(c, migrate_config, "profiles", "copy", "--dry-run")
        assert (dry.summary["scanned"], dry.summary["matched"], dry.summary["would_copy"]) == ("40", "40", "40"), dry.stdout
        assert all_keys(c) == before

        copy = cluster_migrate(c, migrate_config, "profiles", "copy")
        assert (copy.summary["copied"], copy.summary["complete"]) == ("40", "true"), copy.stdout
        assert cluster_migrate(c, migrate_config, "profiles", "verify").summary["same"] == "40"
        assert cluster_migrate(c, migrate_config, "profiles", "copy").summary["up_to_date"] == "40"
        for i, doc in profiles.items():
            key = "user:%d:profile" % i
            assert direct.hgetall(key) == {"name": doc["name"], "age": str(doc["age"])}, key
            assert direct.hgetall(key + ":address") == doc["address"]
            assert direct.get(key + ":tags") == json.dumps(doc["tags"], separators=(",", ":"))
            want = direct.execute_command("PEXPIRETIME", "User_%d_Profile" % i)
            for k in (key, key + ":address", key + ":tags"):
                assert direct.execute_command("PEXPIRETIME", k) == want, (k, want)

        # The app changes one new key before cleanup: its old key is kept (exit 1), the rest go.
        direct.hset("user:7:profile:address", "city", "elsewhere")
        cleanup = cluster_migrate(c, migrate_config, "profiles", "cleanup", check=1)
        assert (cleanup.summary["unlinked"], cleanup.summary["kept.differs"]) == ("39", "1"), cleanup.stdout
        assert ("kept User_7_Profile: user:7:profile differs: user:7:profile:address: field 'city' differs"
                in cleanup.stdout), cleanup.stdout
        assert sorted(k for k in all_keys(c) if k.startswith("User_")) == ["User_7_Profile"]
        win = cluster_migrate(c, migrate_config, "profiles", "cleanup", "--new-keys-win")
        assert win.summary["superseded"] == "1" and direct.exists("User_7_Profile") == 0, win.stdout

        # Plain renames: DUMP and RESTORE across nodes, compared by content.
        copy = cluster_migrate(c, migrate_config, "renames", "copy")
        assert copy.summary["copied"] == "6", copy.stdout
        verify = cluster_migrate(c, migrate_config, "renames", "verify")
        assert verify.summary["same"] == "6", verify.stdout
        assert direct.hgetall("new:big") == {"f%d" % i: "v%d" % i for i in range(600)}
        assert direct.smembers("new:set") == {"m%d" % i for i in range(300)}
        assert direct.zrange("new:z", 0, -1, withscores=True) == [("z%d" % i, i / 3) for i in range(200)]
        assert direct.lrange("new:list", 0, -1) == ["l%d" % i for i in range(50)]
        assert direct.get("new:{t}x") == "tagged" and c.keyslot("new:{t}x") == c.keyslot("Old-{t}x")
        for k, at in old_expiry.items():
            assert direct.execute_command("PEXPIRETIME", "new:" + k[4:]) == at, k
        # A Set member the app adds to the old key: verify and cleanup see the difference.
        direct.sadd("Old-set", "late")
        verify = cluster_migrate(c, migrate_config, "renames", "verify", check=1)
        assert verify.summary["differ"] == "1" and "differs Old-set -> new:set: value differs" in verify.stdout
        cleanup = cluster_migrate(c, migrate_config, "renames", "cleanup", check=1)
        assert (cleanup.summary["unlinked"], cleanup.summary["kept.differs"]) == ("5", "1"), cleanup.stdout
        stale = cluster_migrate(c, migrate_config, "renames", "copy", check=1)
        assert stale.summary["stale"] == "1"
        assert cluster_migrate(c, migrate_config, "renames", "copy", "--refresh").summary["refreshed"] == "1"
        assert "late" in direct.smembers("new:set")
        assert cluster_migrate(c, migrate_config, "renames", "cleanup").summary["unlinked"] == "1"
        assert sorted(k for k in all_keys(c) if k.startswith("Old-")) == []
    finally:
        direct.close()


def test_migrate_on_a_cluster_resumes_across_primaries(fresh, migrate_config):
    """Stopped part-way (--max-keys), the printed cursor names the primary; resumed, the run ends
    with every key done once."""
    c, kg = fresh
    direct = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in c.ports[:2]], decode_responses=True)
    try:
        for i in range(150):
            direct.set("User_%d_Profile" % i, json.dumps({"n": i}))
    finally:
        direct.close()
    first = cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--max-keys", "60", check=3)
    cursor = first.stderr.strip().rsplit("--cursor ", 1)[1]
    assert first.summary["complete"] == "false" and first.summary["cursor"] == cursor
    assert 0 < int(first.summary["copied"]) < 150
    rest = cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--cursor", cursor)
    assert int(first.summary["copied"]) + int(rest.summary["copied"]) == 150, (first.stdout, rest.stdout)
    assert rest.summary.get("up_to_date", "0") == "0"
    assert cluster_migrate(c, migrate_config, "profiles-flat", "verify").summary["same"] == "150"
    bad = cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--db", "1", check=2)
    assert "--db: a Redis Cluster has database 0 only" in bad.stderr
    # The cursor names its primaries (a hash of their addresses after the dash): a cursor of other
    # primaries (a failover, a node added) would resume at the wrong node and skip keys.
    number, layout = cursor.split("-")
    other = "%08x" % (int(layout, 16) ^ 1)
    stale = cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--cursor", number + "-" + other, check=2)
    assert "--cursor: the cluster's primaries changed since this cursor was printed" in stale.stderr
    assert "not a cursor of this cluster" in cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--cursor",
                                                             number, check=2).stderr


def test_migrate_on_a_cluster_with_an_app_writing_through_keyguard(fresh, migrate_config):
    """The app keeps rewriting old keys through keyguard while copy, copy --refresh and cleanup run
    across the nodes. Cleanup may delete an old key only when its new key holds the same value: at
    the end every new key holds the last value the app wrote, and no old key is left."""
    from test_migrate import check_profiles_at_last_version, profile_text
    c, kg = fresh
    n = 1500 if SANITIZED else 4000
    app = client(kg)
    pipe = app.pipeline(transaction=False)
    for i in range(n):
        pipe.set("User_%d_Profile" % i, profile_text(i, 0), **({"ex": 100000} if i % 10 == 0 else {}))
    pipe.execute()
    last = {}
    stop = threading.Event()
    errors = []

    def writer():
        w = client(kg)
        version = 0
        hot = list(range(0, n, 10))
        try:
            while not stop.is_set():
                version += 1
                batch = w.pipeline(transaction=False)
                for i in hot[version % 10::10]:
                    batch.set("User_%d_Profile" % i, profile_text(i, version),
                              **({"ex": 100000 + version} if i % 20 == 0 else {}))
                batch.execute()
                for i in hot[version % 10::10]:
                    last[i] = version
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    t = threading.Thread(target=writer)
    t.start()
    try:
        copy = cluster_migrate(c, migrate_config, "profiles-flat", "copy", check=None)
        assert copy.returncode in (0, 1) and int(copy.summary.get("copied", 0)) > 0, copy.stdout[-2000:] + copy.stderr
        for _ in range(2):
            refresh = cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--refresh", check=None)
            assert refresh.returncode in (0, 1), refresh.stdout[-2000:] + refresh.stderr
        cleanup = cluster_migrate(c, migrate_config, "profiles-flat", "cleanup", check=None)
        assert cleanup.returncode in (0, 1) and int(cleanup.summary.get("unlinked", 0)) > 0, cleanup.stderr
    finally:
        stop.set()
        t.join()
    assert not errors and last, errors
    for _ in range(3):
        cluster_migrate(c, migrate_config, "profiles-flat", "copy", "--refresh")
        if cluster_migrate(c, migrate_config, "profiles-flat", "cleanup", check=None).returncode == 0:
            break
    keys = all_keys(c)
    assert sorted(k for k in keys if k.startswith("User_")) == []
    assert len(keys) == n
    check_profiles_at_last_version(app, n, last)


@pytest.mark.parametrize("step", ["copy", "cleanup", "copy-then-app-deletes"])
def test_migrate_acts_across_nodes_only_on_what_it_checked(fresh, migrate_config, step):
    """One old key, its new key on another node, and four commands a second (max_ops_per_second:
    4): after keyguard reads the old key (seen on the node's MONITOR), the app rewrites it, and
    keyguard's next commands come 0.25 s apart. Copy must not leave a new key made from the first
    value (it is undone and copied again), and cleanup must not delete the old key that now holds
    a value its new key lacks. And an app that moves the key itself right after keyguard wrote the
    new one (it deletes the old key): the new key is then the only copy, and stays."""
    c, kg = fresh
    owners = c.owners(["Slow_%d" % i for i in range(20)] + ["slow:%d" % i for i in range(20)])
    n = next(i for i in range(20) if owners["Slow_%d" % i] != owners["slow:%d" % i])
    old, new = "Slow_%d" % n, "slow:%d" % n
    app = client(kg)
    app.set(old, json.dumps({"v": 0}))
    if step == "cleanup":
        assert cluster_migrate(c, migrate_config, "slow-now", "copy").summary["copied"] == "1"
    from conftest import KEYGUARD
    watch, seen = (owners[new], " %s create" % new) if step == "copy-then-app-deletes" else (owners[old], " %s read" % old)
    with redis.Redis(port=watch, socket_timeout=PATIENCE).monitor() as monitor:
        run = subprocess.Popen([KEYGUARD, "migrate", "--config", migrate_config, "--upstream", seed_url(c),
                                "--migration", "slow", step.split("-")[0], "--no-progress"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while seen not in monitor.next_command()["command"]:
            pass
        if step == "copy-then-app-deletes":
            app.delete(old)
        else:
            app.set(old, json.dumps({"v": 1}))
    out, err = run.communicate(timeout=PATIENCE)
    line = [l for l in out.splitlines() if " scanned=" in l][-1]
    if step == "copy":
        assert run.returncode == 0, out + err
        assert "copied=1" in line and "retried=1" in line, line
        assert app.hgetall(new) == {"v": "1"}
    elif step == "copy-then-app-deletes":
        assert run.returncode == 0, out + err
        assert "gone=1" in line and "copied" not in line, line
        assert app.exists(old) == 0 and app.hgetall(new) == {"v": "0"}
    else:
        assert run.returncode == 1, out + err
        assert "kept.differs=1" in line and "retried=1" in line and "unlinked" not in line, line
        assert app.get(old) == json.dumps({"v": 1}) and app.hgetall(new) == {"v": "0"}


def test_client_id_and_info_leave_a_cluster_client_on_every_node(fresh):
    """StackExchange.Redis sends CLIENT ID as it connects, and tools ask CLIENT INFO: pinned for
    them, the client was on one node's connection for good and its keys on the others were
    refused. Without a connection of its own it gets the answer of keyguard's shared connection to
    the first primary (the same id each time), and keeps reaching every node."""
    c, kg = fresh
    r = client(kg)
    pins = kg.metric('keyguard_upstream_pins_total{reason="client"}')
    ident = r.client_id()
    assert r.client_id() == ident
    info = r.execute_command("CLIENT", "INFO")
    assert info.startswith("id=%d " % ident), info
    assert r.execute_command("CLIENT", "TRACKINGINFO")[1] == ["off"]
    assert r.execute_command("CLIENT", "GETREDIR") == -1
    listed = r.execute_command("CLIENT", "LIST")
    assert "id=%d " % ident in listed
    first = min(c.primaries())
    assert "id=%d " % ident in c.node(first).client.execute_command("CLIENT", "LIST")
    expected = {"cid:%d" % i: str(i) for i in range(60)}
    for k, v in expected.items():
        assert r.set(k, v) is True, k
    assert {k: r.get(k) for k in expected} == expected
    check_stored(c, expected)
    assert kg.metric('keyguard_upstream_pins_total{reason="client"}') == pins
    # With a connection of its own (a transaction's), CLIENT ID is that connection's, and the pin
    # ends with the transaction all the same.
    p = r.pipeline(transaction=True)
    p.set("{cid}a", "1")
    p.client_id()
    own = p.execute()[1]
    assert own != ident
    for k, v in expected.items():
        assert r.set(k, v + "b") is True, k
    # Their wrong forms get the server's arity error, and pin nothing either.
    raw = RespConn(kg.port)
    assert raw.exchange(encode("CLIENT", "INFO", "extra") + encode("CLIENT", "ID", "x") + encode("CLIENT") +
                        encode("GET", "cid:1") + encode("GET", "cid:2") + encode("GET", "cid:3"), replies=6) == (
        b"-ERR wrong number of arguments for 'client|info' command\r\n"
        b"-ERR wrong number of arguments for 'client|id' command\r\n"
        b"-ERR wrong number of arguments for 'client' command\r\n$2\r\n1b\r\n$2\r\n2b\r\n$2\r\n3b\r\n")
    # A redirect is refused, and pins nothing; PREFIX's value may be the word "redirect".
    assert raw.exchange(encode("CLIENT", "TRACKING", "ON", "BCAST", "REDIRECT", "5", "PREFIX", "a") +
                        encode("MGET", *expected), replies=2) == (
        b"-ERR keyguard: CLIENT TRACKING REDIRECT is not served through a Redis Cluster upstream (a client id names "
        b"one node's connection, and CLIENT ID answers keyguard's); use RESP3 tracking (HELLO 3, then CLIENT "
        b"TRACKING ON)\r\n" + encode_reply([v + "b" for v in expected.values()]))
    assert kg.metric('keyguard_upstream_pins_total{reason="client"}') == pins
    assert RespConn(kg.port).call("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "redirect") == "OK"


def test_the_size_probe_lets_go_of_a_node_that_left_the_map():
    """A node that served slots and lost them all (resharded away, as before removing it) is no
    longer in the map: keyguard's shared connections to it retire, and the size probe closes its
    own (it kept it for as long as keyguard ran)."""
    with cluster(primaries=3, replicas=0) as c:
        kg = Keyguard(0, upstream=seed_url(c), threads=1)
        try:
            new = c.add_primary()
            donor = c.primaries()[0]
            c.reshard(donor, new, 20)
            key = next("feed:%d" % i for i in range(100000) if c.node_for_key("feed:%d" % i) == new)
            c.node(new).client.hset(key, mapping={"f%d" % i: i for i in range(5001)})
            r = client(kg)
            assert r.hget(key, "f7") == "7"

            def found():
                return {f["key"] for f in json.loads(kg.http("/debug/findings")[1])["findings"]
                        if f["kind"] == "big_key_access"}

            # (The first HGET's probe may ask the old owner, before keyguard's map knows the move.)
            wait_until(lambda: r.hget(key, "f7") == "7" and key in found(), "the new node's key sized by the probe")

            def others():
                """The connections on the new node other than this test's own (and, once the
                node is emptied, its link to the primary it became a replica of: flag M)."""
                listed = c.node(new).client.execute_command("CLIENT", "LIST")
                return [l for l in listed.splitlines() if "cmd=client|list" not in l and " flags=M " not in l]

            assert others(), "keyguard is connected to the new node"
            c.node(new).client.delete(key)
            c.reshard(new, donor, 20)
            assert r.get("feed:x") is None  # keyguard goes on; it learns the map within 5 s
            wait_until(lambda: not others(), "no connection of keyguard's left on the emptied node", timeout=20)
        finally:
            kg.stop()


def test_commands_keyguard_answers_are_queued_inside_a_transaction(fresh):
    """READONLY and READWRITE inside MULTI were answered +OK at once, and missing from EXEC's
    array; CLUSTER MYID got keyguard's answer in place of +QUEUED. Now the transaction's node
    queues READONLY/READWRITE, and a CLUSTER query keyguard answers as a one-node cluster is
    refused while queued, so EXEC aborts as Redis does for a command refused at queue time."""
    c, kg = fresh
    r = RespConn(kg.port)
    assert r.exchange(encode("MULTI") + encode("SET", "{q}a", "1") + encode("READONLY") + encode("READWRITE") +
                      encode("GET", "{q}a") + encode("EXEC"), replies=6) == (
        b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n*4\r\n+OK\r\n+OK\r\n+OK\r\n$1\r\n1\r\n")
    assert r.exchange(encode("MULTI") + encode("READONLY") + encode("SET", "{q}b", "2") + encode("EXEC"), replies=4) == (
        b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n+OK\r\n")
    assert r.exchange(encode("MULTI") + encode("SET", "{q}c", "3") + encode("CLUSTER", "MYID") + encode("EXEC"),
                      replies=4) == (
        b"+OK\r\n+QUEUED\r\n-ERR keyguard: CLUSTER MYID is not served inside MULTI through keyguard (ask outside "
        b"the transaction)\r\n-EXECABORT Transaction discarded because of previous errors.\r\n")
    # KEYSLOT, and a slot query's error, are the transaction node's, in EXEC's array.
    assert r.exchange(encode("MULTI") + encode("CLUSTER", "KEYSLOT", "foo") + encode("SET", "{q}d", "4") +
                      encode("CLUSTER", "COUNTKEYSINSLOT", "99999") + encode("EXEC"), replies=5) == (
        b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n*3\r\n:12182\r\n+OK\r\n-ERR Invalid slot\r\n")
    # Outside a transaction they are keyguard's answers, as before.
    assert r.exchange(encode("READONLY") + encode("CLUSTER", "MYID"), replies=2).startswith(b"+OK\r\n$40\r\n")
    assert c.client_for_key("{q}b").get("{q}b") == "2" and c.client_for_key("{q}c").get("{q}c") is None


def test_migrate_leaves_a_collection_too_big_to_compare_across_nodes(fresh, migrate_config):
    """A Set of 60,000 members whose new name is on another node: comparing it with its copy there
    takes a digest of its sorted members, which would hold the node for seconds past 50,000. It is
    listed (exit 1) and left; a smaller one moves."""
    c, kg = fresh
    owners = c.owners(["Old-huge%d" % i for i in range(20)] + ["new:huge%d" % i for i in range(20)])
    n = [i for i in range(20) if owners["Old-huge%d" % i] != owners["new:huge%d" % i]][:2]
    big, small = "huge%d" % n[0], "huge%d" % n[1]
    direct = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in c.ports[:2]], decode_responses=True)
    try:
        for start in range(0, 60000, 10000):
            direct.sadd("Old-" + big, *["m%d" % i for i in range(start, start + 10000)])
        direct.sadd("Old-" + small, *["m%d" % i for i in range(20000)])
        copy = cluster_migrate(c, migrate_config, "renames", "copy", check=1)
        assert (copy.summary["copied"], copy.summary["too_big"]) == ("1", "1"), copy.stdout
        assert ("too big Old-%s -> new:%s: a collection of more than 50000 items" % (big, big)) in copy.stdout
        assert direct.exists("new:" + big) == 0 and direct.scard("new:" + small) == 20000
        assert cluster_migrate(c, migrate_config, "renames", "cleanup", check=1).summary["unlinked"] == "1"
        assert direct.scard("Old-" + big) == 60000 and direct.exists("Old-" + small) == 0
    finally:
        direct.close()


def test_an_idle_keyguard_does_not_poll_for_map_refreshes(shared_cluster):
    """The map watcher slept in 50 ms steps to notice a worker's refresh request (20 wake-ups a
    second, idle or not); a request now wakes it directly. An idle keyguard with one worker wakes
    about twice a second (the worker's liveness tick, the config file's poll) and for the map's
    poll every 5 s (a connection, CLUSTER SLOTS and CLUSTER SHARDS: about 10 switches; 5.25 a
    second in all under ASan, in the 4 s looked at)."""
    import glob

    def switches(pid):
        total = 0
        for f in glob.glob("/proc/%d/task/*/status" % pid):
            with open(f) as status:
                total += sum(int(l.split()[1]) for l in status if l.startswith("voluntary_ctxt_switches"))
        return total

    with keyguard_for(shared_cluster) as kg:
        assert client(kg).set("idle:x", "1") is True
        time.sleep(1)
        before = switches(kg.proc.pid)
        time.sleep(4)
        per_second = (switches(kg.proc.pid) - before) / 4
        assert per_second < 8, per_second
        # A MOVED still brings the new map at once (the watcher is woken, not polled).
        refreshes = kg.metric("keyguard_cluster_map_refreshes_total")
        slot = shared_cluster.keyslot("idle:x")
        owner = shared_cluster.node_for_key("idle:x")
        other = next(p for p in shared_cluster.primaries() if p != owner)
        shared_cluster.node(owner).client.delete("idle:x")  # (a slot moves by SETSLOT NODE only empty)
        primaries = shared_cluster.primaries()
        for p in primaries:
            shared_cluster.node(p).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE",
                                                          shared_cluster.node_id(other))
        try:
            r = client(kg)
            assert r.get("idle:y{idle:x}") is None  # MOVED: retried on the new owner
            wait_until(lambda: kg.metric("keyguard_cluster_map_refreshes_total") > refreshes, "a refresh", timeout=2)
        finally:
            for p in primaries:
                shared_cluster.node(p).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE",
                                                              shared_cluster.node_id(owner))
            shared_cluster.wait_agreed()


def test_commands_pipelined_behind_a_transaction_reach_every_node(fresh):
    """A transaction pins the client to its node until EXEC is answered; commands for other nodes
    pipelined right behind EXEC (or behind a blocking pop) were refused as keys of another node.
    They now wait for the pin to end, and go where their keys are."""
    c, kg = fresh
    keys = keys_on_distinct_nodes(c, prefix="tx:")
    r = RespConn(kg.port)
    out = r.exchange(encode("MULTI") + encode("SET", keys[0], "a") + encode("EXEC") + encode("SET", keys[1], "b") +
                     encode("GET", keys[2]) + encode("MULTI") + encode("SET", keys[2], "c") + encode("EXEC") +
                     encode("MGET", *keys), replies=9)
    assert out == (b"+OK\r\n+QUEUED\r\n*1\r\n+OK\r\n+OK\r\n$-1\r\n+OK\r\n+QUEUED\r\n*1\r\n+OK\r\n" +
                   encode_reply(["a", "b", "c"])), out
    out = r.exchange(encode("BLPOP", "{%s}l" % keys[0], "0.2") + encode("GET", keys[1]) + encode("GET", keys[0]),
                     replies=3)
    assert out == b"*-1\r\n$1\r\nb\r\n$1\r\na\r\n", out
    check_stored(c, {keys[0]: "a", keys[1]: "b", keys[2]: "c"})


# --- from a review of the held-command queues (helper-40) ----------------------------------------

def test_a_split_command_waiting_whole_keeps_its_place_in_its_other_slots(fresh):
    """SET a 1 is sent again (ASK) to a node that answers late; MSET a 2 b 2 waits whole behind it.
    SET b 3, sent after the MSET, used to go at once (b's slot was not marked), so the MSET's b
    part ran after it and b ended as 2: the client's order says 3."""
    c, kg = fresh
    a, other, b = keys_on_distinct_nodes(c, prefix="ov")
    slot = c.keyslot(a)
    src, tgt = c.node_for_key(a), c.node_for_key(other)
    begin_migration(c, slot, src, tgt)
    try:
        assert client(kg).set(b, "0") is True
        conn = RespConn(kg.port, timeout=30)
        sleeper = threading.Thread(target=lambda: c.node(tgt).client.execute_command("DEBUG", "SLEEP", "1"))
        sleeper.start()
        time.sleep(0.1)
        conn.sock.sendall(encode("SET", a, "1"))  # ASK (a is not on src), then ASKING + SET on tgt
        time.sleep(0.2)
        conn.sock.sendall(encode("MSET", a, "2", b, "2") + encode("SET", b, "3"))
        assert [conn.read()[1] for _ in range(3)] == [b"+OK\r\n"] * 3
        sleeper.join()
        assert c.node(c.node_for_key(b)).client.get(b) == "3"
        # a, on the importing node (ASKING: the slot is still importing), holds the MSET's 2.
        assert RespConn(tgt).exchange(encode("ASKING") + encode("GET", a), replies=2) == b"+OK\r\n$1\r\n2\r\n"
    finally:
        for p in (src, tgt):
            c.node(p).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(src))


def test_a_split_command_with_many_parts_on_connecting_links_waits_for_them(fresh):
    """A RESP3 client's first MGET (the nodes' RESP3 links are made on first use): each part that
    could not go yet spent one of the command's 20 tries, so an MGET of 120 keys failed at once
    with `cluster node ... unavailable` on a healthy cluster. Each part has its own tries now."""
    c, _ = fresh
    with keyguard_for(c) as kg:
        keys = ["mk%d" % i for i in range(120)]
        assert client(kg).mset({k: k for k in keys}) is True
        conn = RespConn(kg.port)
        assert conn.exchange(encode("HELLO", "3"), replies=1).startswith(b"%")
        conn.send_raw(encode("MGET", *keys))
        assert conn.value() == [k.encode() for k in keys]
        conn.close()


def test_replies_kept_for_their_turn_past_the_bound_do_not_spin_the_worker(fresh):
    """Replies from a fast node kept behind a slow one (DEBUG SLEEP) past limits.max_output_buffer:
    the client's next command made its pump wait on the links' output, which was empty, so it
    returned at once and the worker spun (2.0 s of CPU in 2 s) and served nobody again. Now the
    pump waits until the kept replies are handed over."""
    c, _ = fresh
    import os
    with keyguard_for(c, config="limits:\n  max_output_buffer: 65536\n") as kg:
        slow, fast, _ = keys_on_distinct_nodes(c, prefix="sp")
        assert client(kg).set(fast, "x" * 100000) is True
        conn = RespConn(kg.port, timeout=30)
        sleeper = threading.Thread(target=lambda: c.client_for_key(slow).execute_command("DEBUG", "SLEEP", "1"))
        sleeper.start()
        time.sleep(0.1)
        conn.sock.sendall(encode("GET", slow) + encode("GET", fast) * 3)  # 300 kB kept for their turn
        time.sleep(0.3)

        def cpu():
            with open("/proc/%d/stat" % kg.proc.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        cpu0, t0 = cpu(), time.monotonic()
        conn.sock.sendall(encode("PING"))
        sleeper.join()
        assert conn.read()[1] == b"$-1\r\n"
        for _ in range(3):
            assert conn.read()[1] == b"$100000\r\n" + b"x" * 100000 + b"\r\n"
        assert conn.read()[1] == b"+PONG\r\n"
        used, took = cpu() - cpu0, time.monotonic() - t0
        assert used < took / 2, "keyguard used %.2f s of CPU in %.2f s" % (used, took)
        assert RespConn(kg.port, timeout=10).call("PING") == "PONG"
        conn.close()


def test_a_held_command_keeps_its_pause_whatever_other_replies_come(fresh):
    """A command whose node's connection is being made again is held for a pause of 10 ms per
    try; every reply from another node tried it again at once and spent a try, so behind 300 GETs
    it failed within milliseconds instead of waiting for the node."""
    c, _ = fresh
    with keyguard_for(c) as kg:
        k0, k1, _ = keys_on_distinct_nodes(c, prefix="bt")
        assert client(kg).set(k1, "v") is True
        conn = RespConn(kg.port, timeout=30)
        for _ in range(3):
            c.node(c.node_for_key(k0)).client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            time.sleep(0.02)
            conn.sock.sendall(encode("SET", k0, "x") + encode("GET", k1) * 300)
            assert conn.read()[1] == b"+OK\r\n"
            for _ in range(300):
                assert conn.read()[1] == b"$1\r\nv\r\n"
        conn.close()


def test_a_wide_split_command_waiting_whole_costs_little_per_reply(fresh):
    """An MGET of 5,000 keys (thousands of slots) waiting whole behind a redirected SET marks each
    of its slots; every reply then looked up every marked slot in lists (found by helper-41): the
    square of the slots per reply, about a minute of CPU for this MGET's parts. Now sets, and a
    slot's oldest pending command comes from its cursor at once."""
    import os
    c, kg = fresh
    a, other, _ = keys_on_distinct_nodes(c, prefix="wide")
    slot = c.keyslot(a)
    src, tgt = c.node_for_key(a), c.node_for_key(other)
    keys = [a] + [k for k in ("w%d" % i for i in range(5100)) if c.keyslot(k) != slot][:5000]
    assert client(kg).mset({k: "v" for k in keys[1:]}) is True

    def cpu():
        with open("/proc/%d/stat" % kg.proc.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    begin_migration(c, slot, src, tgt)
    try:
        conn = RespConn(kg.port, timeout=60)
        sleeper = threading.Thread(target=lambda: c.node(tgt).client.execute_command("DEBUG", "SLEEP", "1"))
        sleeper.start()
        time.sleep(0.1)
        conn.sock.sendall(encode("SET", a, "1"))  # ASK, then ASKING + SET on the sleeping node
        time.sleep(0.2)
        cpu0, t0 = cpu(), time.monotonic()
        conn.sock.sendall(encode("MGET", *keys))
        assert conn.read()[1] == b"+OK\r\n"
        assert conn.value() == [b"1"] + [b"v"] * 5000
        used, took = cpu() - cpu0, time.monotonic() - t0
        sleeper.join()
        # (The square of the slots per reply did not finish within the 60 s read timeout, in
        # either build. The ASan build's own cost for 5,000 keys' parts is most of a wall second:
        # 2.9 s of CPU in 3.7 s in CI; the release pass checks the CPU bound.)
        if not SANITIZED:
            assert used < took / 2, "keyguard used %.2f s of CPU in %.2f s" % (used, took)
        conn.close()
    finally:
        for p in (src, tgt):
            c.node(p).client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(src))
