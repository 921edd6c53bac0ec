"""The admin endpoint, the metrics it exposes (checked by promtool and by exact values), and the CLI."""
import os
import subprocess
import tempfile

import redis

from conftest import KEYGUARD, ROOT, Keyguard, parse_log_lines
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


def run(*args, timeout=300, **kw):
    return subprocess.run([KEYGUARD, *args], capture_output=True, text=True, timeout=timeout, **kw)


def test_cli_help_version_and_bad_flags():
    out = run("--help")
    assert out.returncode == 0 and "--upstream URL" in out.stdout
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
                         "read_buffer_size, slow_client_grace_ms)\n" % f.name
    with open(f.name, "w") as g:
        g.write("listen: 127.0.0.1:1\nthreads: 1\ndeny_commands: [flushall]\n")
    out = run("check-config", f.name)
    assert out.returncode == 0 and "deny_commands: [flushall]" in out.stdout and "threads: 1" in out.stdout
    # --listen on the command line wins over listen: in the file.
    kg = Keyguard(redis_server.port, config=open(f.name).read())
    try:
        assert redis.Redis(port=kg.port).ping()
        [listening] = kg.events("listening")  # --threads 2 from the fixture wins over threads: 1
        assert listening["worker_threads"] == 2 and listening["listen"] == "127.0.0.1:%d" % kg.port
    finally:
        assert kg.stop() == 0
    os.unlink(f.name)


def test_check_config_shows_the_script_policy_and_the_tenant_walks():
    strict = run("check-config", os.path.join(ROOT, "examples", "strict.yaml"))
    assert strict.returncode == 0
    assert "  scripts: reject (0 reviewed scripts, 0 reviewed functions)\n" in strict.stdout
    tenants = run("check-config", os.path.join(ROOT, "examples", "tenants.yaml"))
    assert tenants.returncode == 0
    assert ("  flush: walk\n  dbsize: walk\n  randomkey: walk\n  walk_step_keys: 1000\n"
            "  walk_steps_per_second: 250\n  allowed_scripts: 0\n  allowed_functions: 0\n") in tenants.stdout


def test_command_table_from_upstream_and_refusing_upstream():
    from conftest import Redis
    r = Redis("--requirepass", "pw")
    try:
        kg = Keyguard(r.port)
        try:
            assert kg.events("command_table") == [
                {"level": "warn", "event": "command_table", "builtin": 240, "added_from_upstream": 0,
                 "error": "upstream COMMAND INFO unavailable: NOAUTH Authentication required."}]
            c = redis.Redis(port=kg.port, password="pw")
            assert c.set("k", "v") and c.get("k") == b"v"  # the built-in table keeps working
        finally:
            assert kg.stop() == 0
    finally:
        r.stop()


def test_command_table_asked_with_keyguards_own_credentials(tmp_path):
    from conftest import Redis
    r = Redis("--requirepass", "pw")
    secret = tmp_path / "password"
    secret.write_text("pw\n")
    try:
        kg = Keyguard(r.port, config="upstream_auth:\n  password_file: %s\n" % secret)
        try:
            assert kg.events("command_table") == [
                {"level": "info", "event": "command_table", "builtin": 240, "added_from_upstream": 0}]
        finally:
            assert kg.stop() == 0
    finally:
        r.stop()


def test_command_table_log_with_open_upstream(redis_server):
    kg = Keyguard(redis_server.port)
    try:
        assert kg.events("command_table") == [
            {"level": "info", "event": "command_table", "builtin": 240, "added_from_upstream": 0}]
    finally:
        assert kg.stop() == 0


MALFORMED = [
    (b"? [a, b]\n: 1\n", "(top level): a key must be a field name, not a list (line 1, column 3)"),
    (b"key_policy:\n  ? {a: 1}\n  : 2\n", "key_policy: a key must be a field name, not a mapping (line 2, column 5)"),
    (b"threads: &n 2\ndrain_timeout_ms: *nope\n", "line 2, column 19: the referenced anchor is not defined"),
    (b"key_policy:\n  <<: {default_action: warn}\n",
     "key_policy.<<: merge keys are not supported; write the fields out (an alias may stand for a whole value, as in "
     "`rules: *shared_rules`)"),
    (b"threads: !!int 2\n", "threads: tags are not supported (!!int); write the plain value"),
    (b"threads: 1\nthreads: 2\n", "threads: duplicate key (first at line 1)"),
    (b"threads: 4294967296\n", "threads: must be between 0 and 4294967295"),
    (b"threads: -1\n", "threads: must be between 0 and 4294967295"),
    (b"limits: {max_depth: 2147483648}\n", "limits.max_depth: must be between -2147483648 and 2147483647"),
    (b"limits: {max_bulk_len: -9223372036854775809}\n",
     "limits.max_bulk_len: must be between -9223372036854775808 and 9223372036854775807"),
    (b"hygiene: {big_string_bytes: 18446744073709551616}\n",
     "hygiene.big_string_bytes: must be between 0 and 18446744073709551615"),
    (b"limits: [1]\n", "limits: expected a mapping"),
    (b"deny_commands: flushall\n", "deny_commands: expected a list"),
    (b"hygiene: {enabled: 2}\n", "hygiene.enabled: expected true or false"),
    (b"listen: a\x00b\n",
     "line 1, column 10: control character 0x00 is not allowed in YAML text (in a double-quoted string write it as "
     "\\x00)"),
    (b"listen: \xc3\x28\n", "line 1, column 9: invalid UTF-8 (byte 0xc3)"),
    (b"threads: 1\n---\nthreads: 2\n", "line 2, column 1: a second YAML document; a config file holds one"),
]


def test_check_config_refuses_malformed_files_with_the_field_path(tmp_path):
    for i, (data, error) in enumerate(MALFORMED):
        path = tmp_path / ("bad%d.yaml" % i)
        path.write_bytes(data)
        out = subprocess.run([KEYGUARD, "check-config", str(path)], capture_output=True, timeout=60)
        assert (out.returncode, out.stdout, out.stderr) == (2, b"", b"keyguard: %s: %s\n" % (bytes(path), error.encode()))


def test_check_config_files_that_are_not_regular_files(tmp_path):
    def check(path):
        out = run("check-config", str(path), timeout=60)  # a FIFO must not block: 60 s is the bound
        return out.returncode, out.stdout, out.stderr

    assert check(tmp_path) == (2, "", "keyguard: %s: is a directory, not a file\n" % tmp_path)
    missing = tmp_path / "missing.yaml"
    assert check(missing) == (2, "", "keyguard: %s: cannot open: No such file or directory\n" % missing)
    # Tests run as root, which reads a mode-000 file: unreadable here is a path through a file.
    f = tmp_path / "file.yaml"
    f.write_text("threads: 1\n")
    assert check(f / "x.yaml") == (2, "", "keyguard: %s/x.yaml: cannot open: Not a directory\n" % f)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert check(fifo) == (2, "", "keyguard: %s: is not a regular file (a FIFO)\n" % fifo)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * (10 << 20) + b"\n")
    assert check(big) == (2, "", "keyguard: %s: is 10485763 bytes; a config file may have at most 4194304 (4 MiB)\n" % big)
    empty = tmp_path / "empty.yaml"
    empty.write_bytes(b"")
    code, stdout, stderr = check(empty)
    assert (code, stderr) == (0, "") and stdout.startswith("listen: 127.0.0.1:6380\nupstream: 127.0.0.1:6379\n")


def test_proxy_startup_failures_are_json_lines(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"? [a, b]\n: 1\n")
    for args, error in [
        (["--config", str(bad)], "%s: (top level): a key must be a field name, not a list (line 1, column 3)" % bad),
        (["--config", str(tmp_path)], "%s: is a directory, not a file" % tmp_path),
        (["--bogus"], "unknown flag '--bogus' (keyguard --help lists them)"),
        (["--listen", "nocolon"], "--listen: 'nocolon' is not HOST:PORT"),
    ]:
        out = run(*args, timeout=60)
        assert out.returncode == 2 and out.stdout == ""
        assert parse_log_lines(out.stderr.encode()) == [{"level": "error", "event": "startup_failed", "error": error}]
