"""The README's first command: scripts/run.sh builds and runs keyguard, starting a private
redis-server when no upstream is given."""
import os
import signal
import subprocess
import time

import redis

from conftest import ROOT, free_port, parse_log_lines, wait_port


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
        out, _ = proc.communicate(timeout=30)
    assert "started a private redis-server on 127.0.0.1:" in out  # run.sh's own line (text)
    # Every other line is keyguard's, and JSON (run.sh's own lines, and install-deps.sh's when it
    # installs something, are text).
    ours = ("started a private redis-server", "connect with:", "installing:")
    keyguard_lines = parse_log_lines("".join(l for l in out.splitlines(True) if not l.startswith(ours)).encode())
    [listening] = [l for l in keyguard_lines if l["event"] == "listening"]
    assert listening["listen"] == "127.0.0.1:%d" % port
    assert listening["admin"] == "http://127.0.0.1:%d/metrics" % admin
    private = int(out.split("started a private redis-server on 127.0.0.1:")[1].split()[0])
    time.sleep(0.5)
    try:
        redis.Redis(port=private, socket_connect_timeout=1).ping()
        alive = True
    except redis.exceptions.ConnectionError:
        alive = False
    assert not alive, "the private redis-server outlived run.sh"
