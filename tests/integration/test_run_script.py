"""The README's first command: scripts/run.sh builds and runs keyguard, starting a private
redis-server when no upstream is given or the config names none that is reachable, with every
shipped example; and whichever way it ends (Ctrl-C, SIGTERM, keyguard exiting), nothing it
started is left running."""
import glob
import os
import signal
import subprocess
import tempfile

import pytest
import redis

from conftest import PATIENCE, ROOT, Redis, free_port, parse_log_lines, wait_port, wait_until

EXAMPLES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.yaml")))


class RunScript:
    """bash scripts/run.sh in its own process group (as a terminal runs it), on free ports."""

    def __init__(self, *args):
        self.port, self.admin = free_port(), free_port()
        self.proc = subprocess.Popen(["bash", "scripts/run.sh", *args, "--listen", "127.0.0.1:%d" % self.port,
                                      "--admin", "127.0.0.1:%d" % self.admin, "--threads", "1"], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                     text=True)
        self.out = None
        try:
            wait_port(self.port, timeout=300, proc=self.proc)  # it may build first
        except Exception:
            self.stop(signal.SIGTERM)
            raise

    def stop(self, sig):
        """Signals the whole process group, as Ctrl-C (SIGINT) or a supervisor (SIGTERM) does."""
        os.killpg(self.proc.pid, sig)
        self.out, _ = self.proc.communicate(timeout=PATIENCE)
        return self.out

    def keyguard_events(self, name):
        """keyguard's log lines (JSON) with this event; run.sh's own lines (and install-deps.sh's
        when it installs something) are text and left out."""
        ours = ("started a private redis-server", "connect with:", "installing:")
        lines = [line for line in self.out.splitlines(True) if not line.startswith(ours) and " names upstream " not in line]
        return [e for e in parse_log_lines("".join(lines).encode()) if e["event"] == name]

    def private_port(self):
        marker = "started a private redis-server on 127.0.0.1:"
        return int(self.out.split(marker)[1].split()[0]) if marker in self.out else None


def accepts(port):
    try:
        redis.Redis(port=port, socket_connect_timeout=5).ping()
        return True
    except redis.exceptions.AuthenticationError:
        return True
    except redis.exceptions.ConnectionError:
        return False


def assert_nothing_left(run):
    private = run.private_port()
    assert private is not None, run.out
    wait_until(lambda: not accepts(private), "the private redis-server to stop after run.sh")
    assert not accepts(run.port), "keyguard outlived run.sh"
    log_dir = run.out.split("(log: ")[1].split("/redis.log")[0]
    assert not os.path.exists(log_dir), log_dir


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_run_script_starts_private_redis_proxies_and_leaves_nothing(sig):
    run = RunScript()
    try:
        r = redis.Redis(port=run.port)
        assert r.set("hello", "world")
        assert r.get("hello") == b"world"
    finally:
        out = run.stop(sig)
    assert "started a private redis-server on 127.0.0.1:" in out
    [listening] = run.keyguard_events("listening")
    assert listening["listen"] == "127.0.0.1:%d" % run.port
    assert listening["admin"] == "http://127.0.0.1:%d/metrics" % run.admin
    assert_nothing_left(run)


def test_keyguard_exiting_by_itself_stops_the_private_redis():
    run = RunScript()
    pid = int(subprocess.run(["pgrep", "-f", "-s", str(run.proc.pid), "listen 127.0.0.1:%d" % run.port],
                             capture_output=True, text=True, check=True).stdout.split()[-1])
    os.kill(pid, signal.SIGKILL)
    run.out, _ = run.proc.communicate(timeout=PATIENCE)
    assert run.proc.returncode != 0
    assert_nothing_left(run)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_runs_against_a_private_redis(name):
    assert len(EXAMPLES) >= 5
    run = RunScript("--config", "examples/" + name)
    try:
        if name == "tenants.yaml":  # keyguard answers AUTH for the example's users
            r = redis.Redis(port=run.port, username="alice", password="alice-secret")
        else:
            r = redis.Redis(port=run.port)
        assert r.set("user:1:name", "ada")
        assert r.get("user:1:name") == b"ada"
    finally:
        run.stop(signal.SIGINT)
    assert_nothing_left(run)


def test_a_reachable_upstream_in_the_config_is_used_and_an_unreachable_one_is_not():
    server = Redis()
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kg-run-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("upstream: 127.0.0.1:%d\n" % server.port)
        run = RunScript("--config", path)
        try:
            assert redis.Redis(port=run.port).set("via", "config")
        finally:
            out = run.stop(signal.SIGINT)
        assert "private redis-server" not in out
        assert redis.Redis(port=server.port).get("via") == b"config"
        closed = free_port()  # nothing listens there
        with open(path, "w") as f:
            f.write("upstream: 127.0.0.1:%d\n" % closed)
        run = RunScript("--config", path)
        try:
            assert redis.Redis(port=run.port).set("via", "private")
        finally:
            out = run.stop(signal.SIGINT)
        assert "%s names upstream 127.0.0.1:%d, which does not accept connections" % (path, closed) in out
        assert redis.Redis(port=server.port).get("via") == b"config"
        assert_nothing_left(run)
    finally:
        os.unlink(path)
        server.stop()
