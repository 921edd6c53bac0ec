"""Config reload without dropping connections: on a file change (as a ConfigMap update makes),
on SIGHUP, and a bad new file keeping the old config live."""
import os
import shutil
import signal
import tempfile
import time

import redis

from conftest import Keyguard, wait_until
from resp import RespConn, encode

OBSERVE = "key_policy:\n  default_action: observe\n"
REJECT = "key_policy:\n  default_action: reject\n"


def wait_for(fn):
    return wait_until(fn, "the reload")


def test_reload_on_file_change_and_bad_file_keeps_old_config(fresh):
    kg = Keyguard(fresh.port, config=OBSERVE)
    try:
        c = RespConn(kg.port)  # one connection through every reload
        assert c.call("SET", "Bad_Key", "1") == "OK"
        with open(kg.config_path, "w") as f:
            f.write(REJECT + "deny_commands: [FLUSHALL]\n")
        assert wait_for(lambda: kg.metric("keyguard_config_reloads_total") == 1)
        assert kg.metric("keyguard_config_version") == 2
        assert c.exchange(encode("SET", "Bad_Key", "2") + encode("FLUSHALL") + encode("SET", "good:key", "3"),
                          replies=3) == \
            b"-ERR keyguard: key 'Bad_Key' violates rule 'lowercase': use bad:key\r\n" \
            b"-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n+OK\r\n"
        # A broken file: reported, and the last good config stays.
        with open(kg.config_path, "w") as f:
            f.write("key_policy:\n  default_action: rejekt\n")
        assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == 1)
        status, body = kg.http("/config")
        assert status == 200
        assert "version: 2\n" in body
        assert "last_reload_error: %s: key_policy.default_action: 'rejekt' is not one of observe, warn, rewrite, " \
               "reject\n" % kg.config_path in body
        assert "action: reject" in body
        assert isinstance(c.call("SET", "Bad_Key", "4"), Exception)
        assert kg.metric("keyguard_client_connections") >= 1
    finally:
        assert kg.stop() == 0
        os.unlink(kg.config_path)


def test_reload_on_sighup(fresh):
    kg = Keyguard(fresh.port, config=OBSERVE)
    try:
        c = RespConn(kg.port)
        assert c.call("SET", "Bad_Key", "1") == "OK"
        st = os.stat(kg.config_path)
        # Same size and mtime: the file watch cannot see it, only SIGHUP reloads.
        with open(kg.config_path, "w") as f:
            f.write(REJECT + "\n")  # "reject" is one byte shorter than "observe"
        assert os.path.getsize(kg.config_path) == st.st_size
        os.utime(kg.config_path, ns=(st.st_atime_ns, st.st_mtime_ns))
        # A negative check, not a synchronisation: give the 1 s file watch a chance to (wrongly)
        # reload. A slow machine can only make it miss a wrong reload, never fail a good run.
        time.sleep(1.5)
        assert c.call("SET", "Bad_Key", "2") == "OK"  # not reloaded yet
        kg.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: kg.metric("keyguard_config_reloads_total") == 1)
        assert "last_reload_trigger: SIGHUP" in kg.http("/config")[1]
        reply = c.call("SET", "Bad_Key", "3")
        assert isinstance(reply, Exception) and "violates rule 'lowercase'" in str(reply)
    finally:
        assert kg.stop() == 0
        os.unlink(kg.config_path)


def replace(path, data):
    """Writes `data` (bytes) to a new file and renames it over `path` (str or bytes), as editors do."""
    tmp = path + (b".tmp" if isinstance(path, bytes) else ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def test_malformed_files_are_refused_counted_and_keyguard_keeps_proxying(fresh):
    kg = Keyguard(fresh.port, config=OBSERVE)
    p = kg.config_path
    bad = [
        (b"? [a, b]\n: 1\n", "(top level): a key must be a field name, not a list (line 1, column 3)"),
        (b"key_policy: !!map {default_action: reject}\n", "key_policy: tags are not supported (!!map); write the plain value"),
        (b"key_policy: {default_action: reject}\nkey_policy: {}\n", "key_policy: duplicate key (first at line 1)"),
        (b"key_policy:\n  <<: {default_action: reject}\n",
         "key_policy.<<: merge keys are not supported; write the fields out (an alias may stand for a whole value, "
         "as in `rules: *shared_rules`)"),
        (b"key_policy: {default_action: reject}\nthreads: 1\x00\n",
         "line 2, column 11: control character 0x00 is not allowed in YAML text (in a double-quoted string write it "
         "as \\x00)"),
        (b"key_policy: {default_action: reject}\nlisten: \xff\n", "line 2, column 9: invalid UTF-8 (byte 0xff)"),
        (b"limits: {max_bulk_len: 9223372036854775808}\n",
         "limits.max_bulk_len: must be between -9223372036854775808 and 9223372036854775807"),
        (b"threads: [1]\n", "threads: expected a scalar value"),
        (b"key_policy: {default_action: reject}\n" + b"#" * (10 << 20),
         None),  # the size is checked before anything is read
    ]
    try:
        c = RespConn(kg.port)  # one connection through every failed reload
        assert c.call("SET", "Bad_Key", "1") == "OK"
        expected = []
        for data, error in bad:
            replace(p, data)
            expected.append("%s: %s" % (p, error) if error else
                            "%s: is %d bytes; a config file may have at most 4194304 (4 MiB)" % (p, len(data)))
            assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == len(expected)), expected[-1]
            status, body = kg.http("/config")
            assert status == 200 and "last_reload_error: %s\n" % expected[-1] in body, body
        # Not a file at all: a directory, then a FIFO with no writer (which must not block the reload).
        os.unlink(p)
        os.mkdir(p)
        expected.append("%s: is a directory, not a file" % p)
        assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == len(expected))
        os.rmdir(p)
        os.mkfifo(p)
        expected.append("%s: is not a regular file (a FIFO)" % p)
        assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == len(expected))
        kg.proc.send_signal(signal.SIGHUP)
        expected.append(expected[-1])
        assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == len(expected))
        # The first config is still live, on the old connection and on new ones.
        assert kg.metric("keyguard_config_reload_failures_total") == 12
        assert kg.metric("keyguard_config_reloads_total") == 0
        assert kg.metric("keyguard_config_version") == 1
        assert c.call("SET", "Bad_Key", "2") == "OK"
        assert redis.Redis(port=kg.port).get("Bad_Key") == b"2"
        failures = kg.events("config_reload_failed")
        assert [f["error"] for f in failures] == expected
        assert [f["trigger"] for f in failures] == ["file change"] * 11 + ["SIGHUP"]
        assert {f["version"] for f in failures} == {1} and {f["level"] for f in failures} == {"error"}
    finally:
        assert kg.stop() == 0
        os.unlink(p)


def test_reload_failure_line_with_control_characters_quotes_and_bad_utf8_is_json(fresh):
    # The path holds a quote, a backslash, a vertical tab and a byte that is not UTF-8; the value
    # in the file (YAML escapes) a vertical tab, a quote, a backslash and U+00FF.
    top = tempfile.mkdtemp(prefix="kg-reload-")
    d = os.path.join(os.fsencode(top), b'odd "dir" \\ \x0b \xff')
    os.mkdir(d)
    path = os.path.join(d, b"keyguard.yaml")
    with open(path, "wb") as f:
        f.write(OBSERVE.encode())
    kg = Keyguard(fresh.port, extra=("--config", path))
    try:
        replace(path, b'key_policy: {default_action: "a\\x0b\\"\\\\\\u00ff"}\n')
        assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == 1)
        [line] = kg.events("config_reload_failed")  # log_lines() parsed every line as JSON
        # Each byte of the message is one code point in the JSON string.
        assert line["error"].encode("latin-1") == path + \
            b": key_policy.default_action: 'a\x0b\"\\\xc3\xbf' is not one of observe, warn, rewrite, reject"
        assert kg.metric("keyguard_config_version") == 1
        assert RespConn(kg.port).call("SET", "Bad_Key", "1") == "OK"
    finally:
        assert kg.stop() == 0
        shutil.rmtree(top)


def test_configmap_symlink_swap(fresh):
    """As the kubelet updates a mounted ConfigMap: keyguard.yaml -> ..data/keyguard.yaml, and ..data
    (a symlink to a timestamped directory) is replaced atomically by a link to a new directory."""
    top = tempfile.mkdtemp(prefix="kg-configmap-")

    def version(name, text):
        os.mkdir(os.path.join(top, name))
        with open(os.path.join(top, name, "keyguard.yaml"), "wb") as f:
            f.write(text)

    def swap_to(name):
        os.symlink(name, os.path.join(top, "..data_tmp"))
        os.replace(os.path.join(top, "..data_tmp"), os.path.join(top, "..data"))

    version("..2026_12_01_00_00_00.1", OBSERVE.encode())
    os.symlink("..2026_12_01_00_00_00.1", os.path.join(top, "..data"))
    path = os.path.join(top, "keyguard.yaml")
    os.symlink("..data/keyguard.yaml", path)
    kg = Keyguard(fresh.port, extra=("--config", path))
    try:
        c = RespConn(kg.port)
        assert c.call("SET", "Bad_Key", "1") == "OK"
        version("..2026_12_01_00_01_00.2", REJECT.encode())
        swap_to("..2026_12_01_00_01_00.2")
        assert wait_for(lambda: kg.metric("keyguard_config_reloads_total") == 1)
        assert kg.metric("keyguard_config_version") == 2
        assert c.exchange(encode("SET", "Bad_Key", "2")) == \
            b"-ERR keyguard: key 'Bad_Key' violates rule 'lowercase': use bad:key\r\n"
        version("..2026_12_01_00_02_00.3", b"key_policy: {default_action: observe}\n? [a]\n: 1\n")
        swap_to("..2026_12_01_00_02_00.3")
        assert wait_for(lambda: kg.metric("keyguard_config_reload_failures_total") == 1)
        error = "%s: (top level): a key must be a field name, not a list (line 2, column 3)" % path
        assert [e["error"] for e in kg.events("config_reload_failed")] == [error]
        assert "last_reload_error: %s\n" % error in kg.http("/config")[1]
        assert kg.metric("keyguard_config_reloads_total") == 1
        assert kg.metric("keyguard_config_version") == 2
        assert c.exchange(encode("SET", "Bad_Key", "3") + encode("SET", "good:key", "3")) == \
            b"-ERR keyguard: key 'Bad_Key' violates rule 'lowercase': use bad:key\r\n+OK\r\n"
        assert [(e["trigger"], e["version"]) for e in kg.events("config_reloaded")] == [("file change", 2)]
    finally:
        assert kg.stop() == 0
        shutil.rmtree(top)
