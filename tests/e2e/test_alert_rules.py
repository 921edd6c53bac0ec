"""The alert rules as a file: promtool accepts them, their promtool unit tests pass, every alert
has a unit test, a severity and texts that say what to do. test_observability.py runs the same
expressions against a real Prometheus scraping keyguard."""
import os
import subprocess

import yaml

from stack import ALERTS

TESTS = ALERTS.replace("alerts.yaml", "alerts_test.yaml")


def rules():
    with open(ALERTS) as f:
        return [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    r = subprocess.run(["promtool", "check", "rules", ALERTS], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: %d rules found" % len(rules()) in r.stdout


def test_promtool_unit_tests():
    r = subprocess.run(["promtool", "test", "rules", os.path.basename(TESTS)], cwd=os.path.dirname(TESTS),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_unit_test_that_fires_it():
    with open(TESTS) as f:
        tests = yaml.safe_load(f)["tests"]
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c.get("exp_alerts")}
    assert fired == {r["alert"] for r in rules()}


def test_every_alert_has_severity_and_texts():
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    for r in rules():
        assert r["labels"]["severity"] in ("info", "warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 80, r["alert"]
