"""A Redis Cluster upstream: keyguard in front of a real six-node cluster (three primaries, a replica
each) routes every command to the node owning its keys' slots and shows its clients one node that
serves every slot. Every stored key is checked on direct connections to the nodes."""
import contextlib
import threading
import time

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from cluster import SLOTS, cluster, seed_url
from conftest import Keyguard, wait_until
from resp import RespConn

CROSSSLOT = "CROSSSLOT Keys in request don't hash to the same slot"


@contextlib.contextmanager
def keyguard_for(c):
    """keyguard with the cluster `c` as its upstream (two seed nodes); stopped afterwards."""
    kg = Keyguard(0, upstream=seed_url(c))
    try:
        yield kg
    finally:
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
    finally:
        rc.close()
    check_stored(c, expected)


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


def test_moved_slots_are_followed_without_an_error():
    """Slots move to another primary behind keyguard's back (redis-cli, directly): keyguard's
    clients never see MOVED, reads and writes of the moved keys just work."""
    with cluster() as c, keyguard_for(c) as kg:
        r = client(kg)
        expected = {"m:%d" % i: "v%d" % i for i in range(2000)}
        p = r.pipeline(transaction=False)
        for k, v in expected.items():
            p.set(k, v)
        assert p.execute() == [True] * len(expected)
        # keyguard has read every key once: its idea of the slot map is the old one now.
        assert {k: r.get(k) for k in expected} == expected
        before = c.owners(expected)
        source, target = c.primaries()[:2]
        source_slots = c.slots_of(source)
        started = time.monotonic()
        c.reshard(source, target, 1000)
        print("\nresharding 1000 slots took %.2f s" % (time.monotonic() - started))
        assert c.slots_of(source) == source_slots - 1000
        after = c.owners(expected)
        moved = sorted(k for k in expected if before[k] != after[k])
        assert moved and all(before[k] == source and after[k] == target for k in moved), moved[:10]
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


def test_failover_under_write_load():
    """CLUSTER FAILOVER on the replica of the primary owning the keys being written through
    keyguard: the window in which writes fail is measured (and printed), and every write
    acknowledged after the switch is on the new primary."""
    with cluster() as c, keyguard_for(c) as kg:
        old = c.primaries()[0]
        replica = c.replicas_of(old)[0]
        # Keys in old's slots only: four hash tags it owns.
        tags = [t for t in ("{fo%d}" % i for i in range(200)) if c.node_for_key(t) == old][:4]
        assert len(tags) == 4
        acked, failures, stop, lock = [], [], threading.Event(), threading.Lock()

        def writer(t):
            r = client(kg, socket_timeout=5)
            n = 0
            while not stop.is_set():
                n += 1
                k = "%s:%d:%d" % (tags[(n + t) % 4], t, n)
                try:
                    assert r.set(k, "v%d" % n) is True
                    with lock:
                        acked.append((time.monotonic(), k, "v%d" % n))
                except (redis.RedisError, AssertionError) as e:
                    failures.append((time.monotonic(), repr(e)))
                    time.sleep(0.01)

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(acked) >= 300, "writes through keyguard")
            started = time.monotonic()
            assert c.node(replica).client.execute_command("CLUSTER", "FAILOVER") == "OK"
            wait_until(lambda: c.role(replica) == "master", "the replica on %d promoted" % replica)
            switched = time.monotonic()
            c.wait_agreed()
            wait_until(lambda: len([a for a in acked if a[0] > switched]) >= 300,
                       "writes acknowledged after the failover")
        finally:
            stop.set()
            for t in threads:
                t.join()
        # The window: from the first failed write to the first acknowledged after the last one.
        window = 0.0
        if failures:
            window = min(ts for ts, _, _ in acked if ts > failures[-1][0]) - failures[0][0]
        print("\nfailover window: %.2f s (%d failed writes; promoted %.2f s after CLUSTER FAILOVER)%s"
              % (window, len(failures), switched - started,
                 "; first failure %.2f s after it: %s" % (failures[0][0] - started, failures[0][1])
                 if failures else ""))
        assert window < 10, "writes failed for %.2f s: %r" % (window, failures[:10])
        assert c.primaries() == sorted(set(c.primaries()) - {old} | {replica})
        assert all(c.node_for_key(t) == replica for t in tags)
        after = {k: v for ts, k, v in acked if ts > switched}
        assert len(after) >= 300
        node = c.node(replica).client
        p = node.pipeline(transaction=False)
        for k in after:
            p.get(k)
        got = dict(zip(after, p.execute()))
        missing = {k: got[k] for k in after if got[k] != after[k]}
        assert not missing, "%d writes acknowledged after the switch are not on the new primary %d: %r" % (
            len(missing), replica, sorted(missing.items())[:10])
        # A manual failover loses nothing: the replica caught up before it took over.
        check_stored(c, {k: v for ts, k, v in acked})
