#!/usr/bin/env python3
"""A Redis workload with known key-hygiene problems, sent through keyguard with redis-py.

Used by the compose demo and by tests/e2e (both without end, a round every few seconds), so the
dashboards and alerts are checked against the same traffic people see in the demo. Each round:

  naming      SET User_<n>_Profile (rewritten by the demo config's legacy-profile rule),
              SET Session-Token:<n> (lowercase/charset, observed), SET 'cart:<n> item'
              (forbidden_characters, rejected by the demo config)
  rmw         GET a JSON user profile, change one field, SET it back (serialized_rmw), hot
  lost update two connections read the same JSON cart, both write it back (lost_update_risk)
  hash        SET user:<n>:name / :email / :city as three keys (hash_candidate)
  big keys    SET and GET a 20 KB report (big_string_write/read), then DEL it (del_big_key, sent
              as UNLINK by the demo config), SMEMBERS of a 6000-member set
              (whole_collection_read), HGET of a new 6000-field hash (the sizing probe asks Redis
              its size: big_key_access), then EXPIRE (expire_big_key) and DEL (del_big_key) of it
  ttl         SET cache:page:<n> without a TTL (missing_ttl), SET session:<n> then EXPIRE (fine),
              100 tokens SET with the same EX in one pipeline (expiry_clustering)
  dangerous   KEYS user:* (keys_command, refused by the demo config), FLUSHDB without ASYNC on
              scratch db 1 (flush_without_async, ASYNC added by the demo config), FLUSHALL
              (denied by the demo config)
  errors      INCR on a JSON string (an error reply), malformed RESP on a raw socket (protocol
              error), CLIENT KILL of two other connections' upstreams (upstream errors)

With --tenants USER:PASSWORD,... it drives a keyguard with tenancy instead (the demo's second
keyguard, docker/demo/tenants.yaml). Each round, for each user:

  traffic     AUTH as the user, SET/GET/INCR/HSET/LPUSH/SCAN on the tenant's own keys
  refused     SWAPDB 0 1 (reaches outside the tenant's prefix: refused, reason tenant)
  no auth     a connection that sends GET before AUTH (NOAUTH, reason noauth)

usage: workload.py [--host H] [--port P] [--rounds N] [--pause S] [--rmw N] [--tenants U:P,...]
  --rounds 0 runs until killed.
"""
import argparse
import json
import socket
import sys
import time

import redis


def connect(args, **kw):
    # A generous timeout: a loaded machine (the e2e tests run it beside Prometheus and two
    # keyguards on two cores) can be slow, and a timeout here would fail a healthy run.
    return redis.Redis(host=args.host, port=args.port, socket_timeout=60, **kw)


def expect_error(f, *a):
    """Runs one command that keyguard or Redis must refuse; returns the error text."""
    try:
        f(*a)
    except redis.ResponseError as e:
        return str(e)
    raise AssertionError("expected an error reply from %s%r" % (f.__name__, a))


def round_(args, r, n):
    # Naming.
    r.set("User_%d_Profile" % n, "ada")
    r.set("Session-Token:%d" % n, "t")
    expect_error(r.set, "cart:%d item" % n, "1")

    # Serialized read-modify-write on a hot pattern: the profile lives as one JSON blob.
    profile = {"name": "ada", "age": 36, "city": "Paris", "plan": "pro", "score": 0, "tz": "CET"}
    for i in range(args.rmw):
        key = "user:%d:profile" % (i % 20)
        if i < 20:
            r.set(key, json.dumps(profile))
        p = json.loads(r.get(key))
        p["score"] += 1
        r.set(key, json.dumps(p))

    # Lost update: two connections read the same cart, both write it back.
    a, b = connect(args), connect(args)
    a.set("cart:%d" % n, json.dumps({"items": 1, "total": 10}))
    va, vb = json.loads(a.get("cart:%d" % n)), json.loads(b.get("cart:%d" % n))
    va["items"] += 1
    a.set("cart:%d" % n, json.dumps(va))
    vb["total"] += 5
    b.set("cart:%d" % n, json.dumps(vb))
    a.close()
    b.close()

    # One attribute per key: a Hash would do.
    for attr in ("name", "email", "city"):
        r.set("user:%d:%s" % (1000 + n, attr), "x")

    # Big keys.
    r.set("report:%d:blob" % n, "r" * 20480)
    r.get("report:%d:blob" % n)
    if not r.exists("audience:all"):
        r.sadd("audience:all", *range(6000))
    r.smembers("audience:all")
    r.delete("report:%d:blob" % n)
    # A big hash read with HGET, whose reply does not show its size: the sizing probe asks Redis.
    # Then a TTL on it and a DEL of it: both now known to be big.
    r.hset("feed:%d" % n, mapping={"f%d" % i: i for i in range(6000)})
    r.hget("feed:%d" % n, "f7")

    # TTL hygiene: a cache page without a TTL, a session given one right after the write, and a
    # batch of tokens that all expire in the same second.
    r.set("cache:page:%d" % n, "<html>%d</html>" % n)
    r.set("session:%d" % n, "s")
    r.expire("session:%d" % n, 1800)
    p = r.pipeline(transaction=False)
    for i in range(100):
        p.set("token:%d" % (n * 1000 + i), "t", ex=600)
    p.execute()

    r.expire("feed:%d" % n, 600)
    r.delete("feed:%d" % n)

    # Dangerous commands.
    expect_error(r.keys, "user:*")
    scratch = connect(args, db=1)
    scratch.set("scratch:1", "x")
    scratch.flushdb()
    scratch.close()
    expect_error(r.flushall)

    # Errors: an error reply, a protocol error, an upstream connection dropped under a client.
    expect_error(r.incr, "user:0:profile")
    with socket.create_connection((args.host, args.port), timeout=60) as s:
        s.sendall(b"*abc\r\n")
        s.recv(1024)
    for _ in range(2):
        victim = connect(args)
        victim_id = victim.client_id()  # Redis's id of keyguard's upstream connection for this client
        r.client_kill_filter(_id=victim_id)
        try:
            victim.ping()
        except redis.ConnectionError:
            pass
        victim.close()


def tenant_round(args, users, n):
    for user, password in users:
        t = connect(args, username=user, password=password)
        t.set("session:%d" % n, "x" * (100 + 50 * n))
        t.get("session:%d" % n)
        t.incr("visits")
        t.hset("user:%d" % n, mapping={"name": user, "round": n})
        t.lpush("events", "round %d" % n)
        t.ltrim("events", 0, 99)
        t.scan(0, match="user:*", count=100)
        expect_error(t.swapdb, 0, 1)
        t.close()
    anonymous = connect(args)
    try:
        anonymous.get("session:0")
        raise AssertionError("GET before AUTH was not refused")
    except redis.AuthenticationError:  # NOAUTH
        pass
    anonymous.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=6380)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between rounds")
    ap.add_argument("--rmw", type=int, default=100, help="read-modify-writes per round")
    ap.add_argument("--tenants", default="", help="USER:PASSWORD,...: drive a keyguard with tenancy")
    args = ap.parse_args()
    users = [u.split(":", 1) for u in args.tenants.split(",") if u]
    r = None if users else connect(args, client_name="demo-workload")
    n = 0
    while args.rounds == 0 or n < args.rounds:
        try:
            if users:
                tenant_round(args, users, n)
            else:
                round_(args, r, n)
        except redis.ConnectionError as e:  # keyguard or Redis restarting in the demo
            if args.rounds != 0:
                raise
            print("workload: %s; retrying" % e, file=sys.stderr, flush=True)
        n += 1
        if args.rounds == 0 or n < args.rounds:
            time.sleep(args.pause)
    print("workload: %d rounds" % n, flush=True)


if __name__ == "__main__":
    main()
