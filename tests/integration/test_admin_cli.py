"""The admin endpoint, the metrics it exposes (checked by promtool and by exact values), and the CLI."""
import os
import subprocess
import tempfile

import redis

from conftest import KEYGUARD, Keyguard
from resp import RespConn, encode


def test_metrics_exact_values_and_promtool(redis_server):
    kg = Keyguard(redis_server.port, config="deny_commands: [FLUSHALL]\n")
    try:
        r = redis.Redis(port=kg.port)
        for i in range(25):
            r.set("m:%d" % i, "v")
        for i in range(10):
            r.get("m:%d" % i)
        c = RespConn(kg.port)
        assert c.exchange(encode("FLUSHALL") + encode("NOSUCHCOMMAND") + encode("INCR", "m:0"),
                          replies=3).startswith(
            b"-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n-ERR unknown command")
        c.close()
        text = kg.metrics()
        # wait_port() opened one connection, redis-py one, the raw client one.
        assert kg.metric("keyguard_client_connections_total") == 3
        assert kg.metric('keyguard_commands_total{command="set",outcome="ok"}') == 25
        assert kg.metric('keyguard_commands_total{command="get",outcome="ok"}') == 10
        assert kg.metric('keyguard_commands_total{command="flushall",outcome="rejected"}') == 1
        assert kg.metric('keyguard_commands_total{command="unknown",outcome="error"}') == 1
        assert kg.metric('keyguard_commands_total{command="incr",outcome="error"}') == 1
        assert kg.metric('keyguard_command_duration_seconds_count{command="set"}') == 25
        assert kg.metric('keyguard_command_duration_seconds_bucket{command="set",le="+Inf"}') == 25
        assert kg.metric("keyguard_client_protocol_errors_total") == 0
        assert kg.metric("keyguard_upstream_received_bytes_total") > 0
        assert 'keyguard_build_info{version="' in text
        with tempfile.NamedTemporaryFile("w", suffix=".prom", delete=False) as f:
            f.write(text)
        check = subprocess.run("promtool check metrics < %s" % f.name, shell=True, capture_output=True, text=True)
        os.unlink(f.name)
        assert check.returncode == 0, check.stdout + check.stderr
        assert kg.http("/healthz") == (200, "ok\n")
        assert kg.http("/readyz") == (200, "ready\n")
        assert kg.http("/nope")[0] == 404
    finally:
        assert kg.stop() == 0


def run(*args, **kw):
    return subprocess.run([KEYGUARD, *args], capture_output=True, text=True, timeout=300, **kw)


def test_cli_help_version_and_bad_flags():
    out = run("--help")
    assert out.returncode == 0 and "--upstream HOST:PORT" in out.stdout
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("keyguard ")
    out = run("--bogus")
    assert out.returncode == 2 and "unknown flag '--bogus'" in out.stderr
    out = run("--listen", "nocolon")
    assert out.returncode == 2 and "--listen: 'nocolon' is not HOST:PORT" in out.stderr
    out = run("--threads")
    assert out.returncode == 2 and "--threads needs a value" in out.stderr


def test_check_config_and_flag_override(redis_server):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("listen: 127.0.0.1:1\nthreads: 1\nlimits:\n  max_bulk: 5\n")
    out = run("check-config", f.name)
    assert out.returncode == 2
    assert out.stderr == "keyguard: %s: limits.max_bulk: unknown field (known: max_bulk_len, max_depth, " \
                         "max_inline_len, max_multibulk_len, max_output_buffer, max_pending_commands, " \
                         "read_buffer_size)\n" % f.name
    with open(f.name, "w") as g:
        g.write("listen: 127.0.0.1:1\nthreads: 1\ndeny_commands: [flushall]\n")
    out = run("check-config", f.name)
    assert out.returncode == 0 and "deny_commands: [flushall]" in out.stdout and "threads: 1" in out.stdout
    # --listen on the command line wins over listen: in the file.
    kg = Keyguard(redis_server.port, config=open(f.name).read())
    try:
        assert redis.Redis(port=kg.port).ping()
        assert "2 worker threads" in kg.output()  # --threads 2 from the fixture wins over threads: 1
    finally:
        assert kg.stop() == 0
    os.unlink(f.name)


def test_command_table_from_upstream_and_refusing_upstream():
    from conftest import Redis
    r = Redis("--requirepass", "pw")
    try:
        kg = Keyguard(r.port)
        try:
            out = kg.output()
            assert "keyguard: command table: 240 built-in; upstream COMMAND INFO unavailable " \
                   "(NOAUTH Authentication required.)" in out, out
            c = redis.Redis(port=kg.port, password="pw")
            assert c.set("k", "v") and c.get("k") == b"v"  # the built-in table keeps working
        finally:
            assert kg.stop() == 0
    finally:
        r.stop()


def test_command_table_log_with_open_upstream(redis_server):
    kg = Keyguard(redis_server.port)
    try:
        assert "keyguard: command table: 240 built-in, 0 added from the upstream's COMMAND INFO" in kg.output()
    finally:
        assert kg.stop() == 0
