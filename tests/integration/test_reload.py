"""Config reload without dropping connections: on a file change (as a ConfigMap update makes),
on SIGHUP, and a bad new file keeping the old config live."""
import os
import signal
import time

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
