"""Detector memory stays flat as distinct keys grow: every detector's state is bounded per worker
(serialized-value tracker, attribute tracker, size cache, probe queue, expiry ring, hot-key
sketches), so keyguard's RSS after KG_MEMORY_KEYS distinct keys (400k in the suite; 1M with
bench/detector_memory.sh) is what it was after the first fifth of them."""
import os
import subprocess

import pytest

from conftest import SANITIZED, Keyguard, Redis

CONFIG = """hygiene:
  ttl_patterns:
    - {pattern: "cache:*", kind: cache}
  missing_ttl_window_ms: 1
  hot_keys_sample: 1
"""


def load(port, keys):
    """`keys` distinct keys per family, through redis-benchmark (hiredis, pipelined): JSON values
    read and written back (read-modify-write tracker), one attribute per key (attribute tracker),
    cache keys without TTL (missing_ttl), TTLs (expiry ring), HGETs of unknown keys (probe queue)."""
    families = [
        ["SET", "profile:__rand_int__", '{"name":"ada","age":36,"plan":"pro"}'],
        ["GET", "profile:__rand_int__"],
        ["SET", "user:__rand_int__:name", "ada"],
        ["SET", "cache:__rand_int__", "v", "EX", "3600"],
        ["SET", "cache:x__rand_int__", "v"],
        ["HGET", "feed:__rand_int__", "f"],
    ]
    for cmd in families:
        # __rand_int__ draws from [0, keys): the second phase brings 800k keys never seen before.
        out = subprocess.run(["redis-benchmark", "-p", str(port), "-n", str(keys), "-r", str(keys), "-P", "32",
                              "-c", "4", "-q", *cmd], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr


@pytest.mark.skipif(SANITIZED, reason="ASan's quarantine holds freed memory; RSS bounds are checked on release")
def test_rss_is_flat_as_distinct_keys_grow():
    total = int(os.environ.get("KG_MEMORY_KEYS", "400000"))
    r = Redis()
    kg = Keyguard(r.port, config=CONFIG)
    try:
        load(kg.port, total // 5)
        rss_first = kg.rss_kb()
        load(kg.port, total)
        rss_all = kg.rss_kb()
        # The detectors were busy all along: cache keys without TTL, probed keys, hot keys.
        assert kg.metric('keyguard_findings_total{kind="missing_ttl",key_pattern="cache:x{id}"}') > 0
        assert kg.metric("keyguard_probed_keys_total") > 0
        print("\nkeyguard RSS: %d kB after %d keys per family, %d kB after %d (+%d kB)"
              % (rss_first, total // 5, rss_all, total, rss_all - rss_first))
        assert rss_all - rss_first < 8 * 1024, (rss_first, rss_all)
    finally:
        assert kg.stop() == 0, kg.output()[-2000:]
        r.stop()
