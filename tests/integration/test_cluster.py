"""A Redis Cluster upstream: a real six-node cluster (three primaries, a replica each)."""
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
    return redis.Redis(port=kg.port, decode_responses=True, socket_timeout=10, **kw)


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
