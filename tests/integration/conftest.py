"""Fixtures: a real redis-server and real keyguard processes on free ports."""
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

from resp import PATIENCE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYGUARD = os.environ.get("KEYGUARD_BIN", os.path.join(ROOT, "build", "keyguard"))
# The ASan build keeps freed memory in quarantine, so RSS bounds are checked on release only.
SANITIZED = "build-asan" in KEYGUARD


_handed_out = set()
# Under pytest-xdist each worker takes ports from its own block below the kernel's ephemeral range
# (32768 and up), so two workers never hand out the same port and no client's source port lands
# on one; a single process keeps the kernel's choice.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_next_port = [10000 + 5000 * int(_WORKER[2:])] if _WORKER.startswith("gw") and _WORKER[2:].isdigit() else None


def free_port():
    """A loopback port nothing listens on now, never one this process handed out before. Another
    socket can still take it before the caller binds it (the kernel also hands it out as a client's
    source port), so the fixtures that listen on it retry with new ports when that happens."""
    while True:
        s = socket.socket()
        if _next_port is not None:
            port = _next_port[0]
            _next_port[0] += 1
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
        else:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        s.close()
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_until(predicate, what="the condition", timeout=PATIENCE, interval=0.02):
    """Polls predicate() until it returns something truthy and returns that; fails after `timeout`
    (generous: a passing run returns as soon as the condition holds, however slow the machine).
    Tests wait on the condition itself with this, never on a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s (last value %r)" % (timeout, what, v))
        time.sleep(interval)


def blocked_clients(port):
    """INFO clients' blocked_clients of the redis-server on `port`, read on a direct connection."""
    import redis
    c = redis.Redis(port=port)
    try:
        return c.info("clients")["blocked_clients"]
    finally:
        c.close()


def wait_blocked(port, n=1):
    """Waits until at least `n` clients are blocked in the redis-server on `port` (a BLPOP has
    arrived there)."""
    wait_until(lambda: blocked_clients(port) >= n, "%d blocked client(s) on redis port %d" % (n, port))


def wait_port(port, timeout=PATIENCE, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("process exited with %s" % proc.returncode)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("port %d did not open" % port)


def start_listening(what, start):
    """Calls start(), which picks ports with free_port() and starts a process listening on them,
    returning (process, a function that gives its output so far, its ports), and waits for the
    ports. Another socket can take a port before the process binds it: then, and only then, it
    starts again on new ports (5 attempts)."""
    for attempt in range(5):
        proc, output, ports = start()
        try:
            for port in ports:
                wait_port(port, proc=proc)
            return
        except RuntimeError:
            out = output()
            if proc.poll() is None or "Address already in use" not in out or attempt == 4:
                raise RuntimeError("%s did not start: %s" % (what, out[-2000:]))


def output_file():
    """A temporary file for a child process's output, and the handle to give the child as its
    stdout (the caller closes it once the child is started): an open file of its own, appending, so
    that file_output's seek(0) and reads never move where the child writes (with one shared offset
    a read could rewind it, and the child's next line overwrote the first)."""
    f = tempfile.TemporaryFile()
    return f, open("/proc/self/fd/%d" % f.fileno(), "ab")


def file_output(f):
    """What the process writing to the file `f` has written so far."""
    def output():
        f.seek(0)
        return f.read().decode(errors="replace")
    return output


# KEYGUARD_UPSTREAM=cluster runs the suites scripts/test.sh names with a Redis Cluster upstream: every
# plain redis-server a test starts is a one-node cluster owning every slot (so direct checks on it
# still see every key), and every keyguard in front of one is started with redis-cluster://.
CLUSTER_MODE = os.environ.get("KEYGUARD_UPSTREAM", "") == "cluster"
_cluster_ports = set()


class Redis:
    def __init__(self, *extra, tls=None):
        """`tls`: {"cert": PATH, "key": PATH, "ca": PATH} to serve TLS only on self.port (as
        redis-server --tls-port, with --port 0); extra arguments follow (e.g. --tls-auth-clients)."""
        self.dir = tempfile.mkdtemp(prefix="kg-redis-")

        cluster = CLUSTER_MODE and tls is None and not any(a in ("--replicaof", "--slaveof", "--sentinel")
                                                            for a in extra)

        def start():
            self.port = free_port()
            while cluster and self.port > 55535:  # a cluster node's bus port is its port + 10000
                self.port = free_port()
            log, out = output_file()
            ports = ["--port", str(self.port)]
            if tls is not None:
                ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", tls["cert"],
                         "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"]]
            with out:
                self.proc = subprocess.Popen(
                    ["redis-server", *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", self.dir, "--enable-debug-command", "yes", *extra],
                    stdout=out, stderr=subprocess.STDOUT)
            return self.proc, file_output(log), [self.port]

        if cluster:
            extra = extra + ("--cluster-enabled", "yes", "--cluster-config-file",
                             os.path.join(self.dir, "nodes.conf"))
        start_listening("redis-server", start)
        if cluster:
            import redis
            password = extra[extra.index("--requirepass") + 1] if "--requirepass" in extra else None
            c = redis.Redis(port=self.port, password=password)
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")

            def ok():
                info = c.execute_command("CLUSTER", "INFO")  # a dict (redis-py parses it) or the text
                return info.get("cluster_state") == "ok" if isinstance(info, dict) else b"cluster_state:ok" in info
            wait_until(ok, "the one-node cluster to be ok")
            _cluster_ports.add(self.port)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(PATIENCE)


# Every keyguard a test started; after the test, each one's output must be JSON lines only.
_started = []

# KEYGUARD_UPSTREAM_CONNECTIONS=shared runs every keyguard a test starts with shared upstream
# connections (scripts/test.sh runs the proxy core's suites that way too).
UPSTREAM_CONNECTIONS = os.environ.get("KEYGUARD_UPSTREAM_CONNECTIONS", "")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "not_cluster(reason): asserts what differs with a Redis Cluster upstream (KEYGUARD_UPSTREAM=cluster) "
        "for `reason`: a cluster serves database 0 only, keyguard answers CLUSTER itself, ...")
    config.addinivalue_line(
        "markers", "alone(reason): measures a rate or a bound that another test's load on the same cores changes; "
        "scripts/test.sh runs these one at a time after the parallel pass (pytest -n 2 -m 'not alone')")
    config.addinivalue_line(
        "markers", "dedicated_only(reason): asserts what only a connection per client does; with shared "
        "upstream connections the result differs for `reason` (test_shared_upstream.py asserts that)")


def pytest_collection_modifyitems(config, items):
    """The tests whose results must differ with shared upstream connections, each with the reason:
    `grep -rn dedicated_only tests/integration` lists them."""
    if UPSTREAM_CONNECTIONS != "shared" and not CLUSTER_MODE:
        return
    for item in items:
        m = item.get_closest_marker("dedicated_only")
        if m is not None:
            item.add_marker(pytest.mark.skip(reason="shared upstream connections: " + m.kwargs["reason"]))
        m = item.get_closest_marker("not_cluster")
        if m is not None and CLUSTER_MODE:
            item.add_marker(pytest.mark.skip(reason="a Redis Cluster upstream: " + m.kwargs["reason"]))


class Keyguard:
    def __init__(self, upstream_port, config=None, threads=2, extra=(), upstream=None):
        """`upstream`: the --upstream URL, when not 127.0.0.1:`upstream_port`."""
        self.upstream_port = upstream_port
        args = [KEYGUARD]
        self.config_path = None
        if config is not None:
            fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kg-")
            with os.fdopen(fd, "w") as f:
                f.write(config)
            args += ["--config", path]
            self.config_path = path

        def start():
            self.port, self.admin_port = free_port(), free_port()
            target = "127.0.0.1:%d" % upstream_port
            if upstream is None and upstream_port in _cluster_ports:
                target = "redis-cluster://" + target
            listen = ["--listen", "127.0.0.1:%d" % self.port,
                      "--upstream", upstream if upstream is not None else target,
                      "--admin", "127.0.0.1:%d" % self.admin_port, "--threads", str(threads), *extra]
            if UPSTREAM_CONNECTIONS and "--upstream-connections" not in extra:
                listen += ["--upstream-connections", UPSTREAM_CONNECTIONS]
            self.log, out = output_file()
            with out:
                self.proc = subprocess.Popen(args + listen, stdout=out, stderr=subprocess.STDOUT)
            return self.proc, self.output, [self.port, self.admin_port]

        start_listening("keyguard", start)
        _started.append(self)

    def http(self, path):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.admin_port, path), timeout=PATIENCE) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self):
        status, text = self.http("/metrics")
        assert status == 200
        return text

    def metric(self, series):
        """The value of one exact series line, e.g. 'keyguard_commands_total{command="get",outcome="ok"}';
        0 when the series is absent."""
        for line in self.metrics().splitlines():
            if line.startswith(series + " "):
                return float(line.split(" ")[-1])
        return 0.0

    def output(self):
        return file_output(self.log)()

    def log_lines(self):
        """Every line keyguard wrote (stdout and stderr), each parsed as a JSON object; fails the
        test on a line that is not one (keyguard's log is JSON lines only, for log pipelines)."""
        return parse_log_lines(self.log_bytes())

    def log_bytes(self):
        self.log.seek(0)
        return self.log.read()

    def events(self, name):
        """The log lines whose "event" is `name`, in order."""
        return [line for line in self.log_lines() if line.get("event") == name]

    def stop(self, sig=signal.SIGTERM, timeout=PATIENCE):
        """Sends `sig` and returns the exit status. A keyguard still running `timeout` s later is
        killed (so it holds no port or upstream connection for the tests after) and the test fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail("keyguard did not exit within %s s of signal %d; killed. Its output ends: %s"
                            % (timeout, sig, self.output()[-2000:]))
        return self.proc.returncode

    def rss_kb(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


def parse_log_lines(raw):
    """`raw` (bytes) as JSON objects, one a line; pytest.fail names the first line that is not."""
    lines = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line:
            continue
        try:
            value = json.loads(line.decode("utf-8"))
        except ValueError as e:
            pytest.fail("keyguard output line %d is not JSON (%s): %r" % (n, e, line))
        if not isinstance(value, dict):
            pytest.fail("keyguard output line %d is not a JSON object: %r" % (n, line))
        lines.append(value)
    return lines


@pytest.fixture(autouse=True)
def keyguard_logs_are_json():
    """After each test, everything the keyguard processes it started wrote must be JSON lines."""
    yield
    started = list(_started)
    del _started[:]
    for kg in started:
        kg.log_lines()


@pytest.fixture(scope="session")
def redis_server():
    r = Redis()
    yield r
    r.stop()


DENY_CONFIG = "deny_commands: [FLUSHALL, SHUTDOWN]\n"


@pytest.fixture(scope="module")
def keyguard(redis_server):
    kg = Keyguard(redis_server.port, config=DENY_CONFIG)
    yield kg
    assert kg.stop() == 0, kg.output()


@pytest.fixture
def fresh(redis_server):
    """Empties the shared redis-server before a test."""
    import redis
    redis.Redis(port=redis_server.port).flushall()
    return redis_server
