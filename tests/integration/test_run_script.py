"""The README's first command: scripts/run.sh builds and runs keyguard, starting a private
redis-server when no upstream is given."""
import os
import signal
import subprocess

import redis

from conftest import PATIENCE, ROOT, free_port, wait_port, wait_until


def test_run_script_starts_private_redis_and_proxies():
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(["bash", "scripts/run.sh", "--listen", "127.0.0.1:%d" % port, "--admin",
                             "127.0.0.1:%d" % admin, "--threads", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        wait_port(port, timeout=300, proc=proc)
        r = redis.Redis(port=port)
        assert r.set("hello", "world")
        assert r.get("hello") == b"world"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=PATIENCE)
    assert "started a private redis-server on 127.0.0.1:" in out
    assert "listening on 127.0.0.1:%d" % port in out
    assert "admin http://127.0.0.1:%d/metrics" % admin in out
    private = int(out.split("started a private redis-server on 127.0.0.1:")[1].split()[0])

    def gone():
        try:
            redis.Redis(port=private, socket_connect_timeout=5).ping()
            return False
        except redis.exceptions.ConnectionError:
            return True
    wait_until(gone, "the private redis-server to stop after run.sh")
