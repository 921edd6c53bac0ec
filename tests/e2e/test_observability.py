"""End to end: redis-server, the compose demo's two keyguards (docker/demo/keyguard.yaml's policy;
docker/demo/tenants.yaml's tenants alice and bob, with keyguard's own upstream credentials) and a
real Prometheus that scrapes both every second and evaluates the chart's alert rules. The compose
demo's workload (docker/demo/workload.py, redis-py) runs through each keyguard (through the first
one without end, as in the demo, so that the hot-key gauge, which shows only the last complete
interval, is there while the dashboards are read; through the tenants' one until the alerts it
drives are active), a bad config is loaded and fixed, the upstream password is rotated in Redis
behind the tenants' keyguard, and then every PromQL expression of both Grafana dashboards
(variables substituted as Grafana would) and every alert rule is asked of Prometheus: each must
parse and evaluate, and each must return what this workload makes. The exceptions are listed
below with the reason.

Nothing here depends on how fast the machine is: the alerts asserted to fire are the ones whose
inputs are counters the workload drives (each waited for, with a generous bound); alerts on
latency or on rates of the workload are only checked to evaluate, and their firing and not firing
is tested by promtool on synthetic series (helm/keyguard/files/prometheus/alerts_test.yaml)."""
import json
import os
import re
import subprocess
import time

import pytest
import redis
import yaml

from stack import ALERTS, DASHBOARDS, PATIENCE, ROOT, SYSTEM_PYTHON, Keyguard, Prometheus, Redis

DEMO_CONFIG = os.path.join(ROOT, "docker", "demo", "keyguard.yaml")
TENANTS_CONFIG = os.path.join(ROOT, "docker", "demo", "tenants.yaml")
UPSTREAM_PASSWORD = os.path.join(ROOT, "docker", "demo", "upstream-password")
WORKLOAD = os.path.join(ROOT, "docker", "demo", "workload.py")
LABELS = {"namespace": "e2e", "pod": "keyguard-0"}
TENANTS_LABELS = {"namespace": "e2e", "pod": "keyguard-tenants-0"}
TENANT_USERS = "alice:alice-secret,bob:bob-secret"

# Dashboard targets that return series whose value is 0 after this workload, and why. Every other
# target must return at least one series with a value above 0; no target may return nothing.
ZERO_TARGETS = {
    ("keyguard-proxy", "Errors", "D"):
        "unexpected replies count replies that match no command: a keyguard bug, never in a healthy run",
    ("keyguard-proxy", "Draining", "A"): "nothing drains while the test queries; the gauge is present at 0",
}
# Alerts that must never fire in a healthy run, and why.
QUIET_ALERTS = {
    "KeyguardUnexpectedReplies": "a healthy keyguard never sees a reply that matches no command",
    "KeyguardSharedLinkDesync": "a healthy server answers each command on a shared connection with one frame",
}
# Alerts whose outcome depends on how fast the machine runs the workload, and why: here they must
# parse and evaluate (health ok) and, if they fire, carry the right labels; whether they fire is
# tested on synthetic series with promtool (test_alert_rules.py), firing and not firing.
TIMING_ALERTS = {
    "KeyguardLatencyOverBudget": "p99 latency: on a loaded machine the demo's big reads can take over 10 ms",
    "KeyguardSerializedRMWHotPattern": "a rate threshold (> 1 a second): a slow machine runs fewer rounds a second",
    "KeyguardHotKeyPattern": "accesses per hot-key interval (>= 100 in 5 s): a slow machine makes fewer",
}
# Grafana's built-in interval variables, as they would be for the last quarter hour: wide enough
# that the tenants' workload, which ends before the dashboards are read, still shows in rates
# however slowly the setup ran.
INTERVALS = {"$__rate_interval": "15m", "$__range": "15m", "$__interval": "15s"}
# The variable selections tried: All (Grafana's allValue ".*"), and a namespace with both pods and
# one or both tenants picked (Grafana writes a multi-value pick as (a|b) in a regex matcher).
SELECTIONS = [
    {"namespace": ".*", "pod": ".*", "tenant": ".*"},
    {"namespace": "e2e", "pod": "(keyguard-0|keyguard-tenants-0)", "tenant": "a"},
    {"namespace": "e2e", "pod": ".*", "tenant": "(a|b)"},
]


def dashboards():
    out = {}
    for name in sorted(os.listdir(DASHBOARDS)):
        with open(os.path.join(DASHBOARDS, name)) as f:
            d = json.load(f)
        out[d["uid"]] = d
    return out


def targets(dashboard):
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            yield p["title"], t["refId"], t["expr"]


def substitute(expr, selection):
    for k, v in INTERVALS.items():
        expr = expr.replace(k, v)
    for k, v in selection.items():
        expr = expr.replace("${%s}" % k, v).replace("$" + k, v)
    assert "$" not in expr, "unsubstituted variable in " + expr
    return expr


def alert_rules():
    with open(ALERTS) as f:
        groups = yaml.safe_load(f)["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def workload(port, *extra, rounds=5):
    return subprocess.Popen([SYSTEM_PYTHON, WORKLOAD, "--port", str(port), "--rounds", str(rounds), "--pause", "1.2",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def driven_alerts():
    """The alerts this workload drives through counters: each must be pending or firing."""
    return {r["alert"] for r in alert_rules()} - set(QUIET_ALERTS) - set(TIMING_ALERTS)


def stop(proc):
    """Ends a workload that runs without end; it must not have failed before."""
    assert proc.poll() is None, proc.communicate()[0]
    proc.terminate()
    proc.communicate(timeout=PATIENCE)


@pytest.fixture(scope="module")
def stack():
    started = time.time()
    # The ACL user the tenants' keyguard authenticates as, from compose.yaml's redis command.
    with open(os.path.join(ROOT, "docker", "compose.yaml")) as f:
        cmd = yaml.safe_load(f)["services"]["redis"]["command"]
    server = Redis(*cmd[cmd.index("--user"):])
    direct = redis.Redis(port=server.port)
    with open(DEMO_CONFIG) as f:
        good_config = f.read()
    with open(TENANTS_CONFIG) as f:
        tenants_config = f.read().replace("/etc/keyguard/demo/upstream-password", UPSTREAM_PASSWORD)
    kg = Keyguard(server.port, config=good_config, threads=1)  # detector state is per worker thread
    kt = Keyguard(server.port, config=tenants_config, threads=1)
    prom = Prometheus({"127.0.0.1:%d" % kg.admin_port: LABELS, "127.0.0.1:%d" % kt.admin_port: TENANTS_LABELS},
                      rule_files=[ALERTS])
    demo = tenants = None
    try:
        prom.wait_for('up{job="keyguard"}', lambda v: v == 2)
        # The demo's workload runs until the end (its connection is the idle-between-rounds client the
        # Connections panel shows); the tenants' workload runs until Prometheus holds the alert its
        # refusals drive for both tenants (a counter is born at its first increment, so its increase
        # shows only once a later round has added to it), then ends before the password rotation.
        demo, tenants = workload(kg.port, "--rmw", "150", rounds=0), workload(kt.port, "--tenants", TENANT_USERS, rounds=0)
        wait_alerts(prom, lambda active: "KeyguardTenantRejectionsRising" in active and
                    len(alerts_named(prom, "KeyguardTenantRejectionsRising")) == 2)
        stop(tenants)
        # A bad config is refused (the old one stays live), then the fixed one is loaded.
        with open(kg.config_path, "w") as f:
            f.write("key_policy:\n  default_action: sideways\n")
        prom.wait_for("keyguard_config_reload_failures_total", lambda v: v == 1)
        with open(kg.config_path, "w") as f:
            f.write(good_config)
        prom.wait_for("keyguard_config_reloads_total", lambda v: v == 1)
        # The upstream password is rotated in Redis but not in keyguard's file: Redis refuses
        # keyguard's AUTH on the next upstream connection, and the client gets an error (with
        # tenancy keyguard answers the client's AUTH itself, and the connection is closed).
        direct.execute_command("ACL", "SETUSER", "keyguard", "resetpass", ">rotated-in-redis-only")
        late = redis.Redis(port=kt.port, username="alice", password="alice-secret")
        with pytest.raises(redis.RedisError):
            late.ping()
        late.close()
        prom.wait_for('keyguard_upstream_errors_total{reason="auth"}', lambda v: v >= 1)
        prom.wait_for('keyguard_hot_key_pattern_accesses{pod="keyguard-0"}', lambda v: v > 0)
        # Rules are evaluated every second; wait until every alert the workload drives is active.
        wait_alerts(prom, lambda active: driven_alerts() <= active)
        # An alert is active once one of its series is: KeyguardDelOfBigKeys holds a series per
        # pattern, and each pattern's DELs reach the threshold in their own round. Wait for both.
        wait_alerts(prom, lambda _: sorted(a["labels"]["key_pattern"] for a in alerts_named(prom, "KeyguardDelOfBigKeys"))
                    == ["feed:{id}", "report:{id}:blob"])
        print("e2e stack ready in %.1fs" % (time.time() - started))
        assert demo.poll() is None, demo.communicate()[0]
        yield kg, prom
        assert demo.poll() is None, demo.communicate()[0]  # no workload round failed while the tests ran
    finally:
        for proc in (demo, tenants):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.communicate(timeout=PATIENCE)
        direct.close()
        prom.stop()
        assert kt.stop() == 0, kt.output()
        assert kg.stop() == 0, kg.output()
        server.stop()


def active_alerts(prom):
    r = prom.get("/api/v1/alerts")
    return {a["labels"]["alertname"] for a in r["data"]["alerts"] if a["state"] in ("pending", "firing")}


def alerts_named(prom, name):
    return [a for a in prom.get("/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"] == name]


def wait_alerts(prom, ok):
    """Waits until ok(the set of pending or firing alert names) holds, with a generous bound."""
    deadline = time.time() + PATIENCE
    while not ok(active := active_alerts(prom)):
        if time.time() > deadline:
            raise AssertionError("alerts active after %.0f s: %s; expected: %s"
                                 % (PATIENCE, sorted(active), sorted(driven_alerts())))
        time.sleep(0.2)


@pytest.mark.parametrize("uid", ["keyguard-hygiene", "keyguard-proxy"])
def test_every_dashboard_query_parses_and_shows_the_workload(stack, uid):
    _, prom = stack
    failures, checked = [], 0
    for selection in SELECTIONS:
        for title, ref, expr in targets(dashboards()[uid]):
            q = substitute(expr, selection)
            r = prom.query(q)
            checked += 1
            if r["status"] != "success":
                failures.append("%s/%s: %s: %s" % (title, ref, q, r.get("error")))
                continue
            values = [float(s["value"][1]) for s in r["data"]["result"]]
            if not values:
                failures.append("%s/%s returned nothing: %s" % (title, ref, q))
            elif (uid, title, ref) not in ZERO_TARGETS and not any(v > 0 for v in values):
                failures.append("%s/%s is %s, expected > 0: %s" % (title, ref, values, q))
    assert not failures, "\n".join(failures)
    assert checked >= 20


def test_zero_targets_exist():
    listed = {(uid, title, ref) for uid, d in dashboards().items() for title, ref, _ in targets(d)}
    assert set(ZERO_TARGETS) <= listed


def test_dashboard_variables_offer_the_scraped_labels(stack):
    _, prom = stack
    for d in dashboards().values():
        for v in d["templating"]["list"]:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"]["query"])
            assert m, v["query"]
            match = substitute(m.group(1), {"namespace": ".*", "pod": ".*"})
            r = prom.get("/api/v1/label/%s/values" % m.group(2), **{"match[]": match})
            assert r["status"] == "success", r
            expected = {"namespace": ["e2e"], "pod": ["keyguard-0", "keyguard-tenants-0"],
                        "tenant": ["a", "b"]}[v["name"]]  # the tenants of docker/demo/tenants.yaml
            assert r["data"] == expected, (v["name"], r)


def test_every_alert_expression_parses_and_the_workload_fires_the_expected_ones(stack):
    _, prom = stack
    fired, failures = set(), []
    for rule in alert_rules():
        r = prom.query(rule["expr"])
        if r["status"] != "success":
            failures.append("%s: %s" % (rule["alert"], r.get("error")))
        elif r["data"]["result"]:
            fired.add(rule["alert"])
    assert not failures, failures
    assert driven_alerts() <= fired, sorted(driven_alerts() - fired)
    assert not fired & set(QUIET_ALERTS), sorted(fired & set(QUIET_ALERTS))


def test_prometheus_evaluates_every_rule_and_holds_the_expected_alerts(stack):
    _, prom = stack
    rules = [r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    active = active_alerts(prom)
    assert driven_alerts() <= active and not active & set(QUIET_ALERTS), sorted(active)
    # The labels the alerts carry come from the scrape (namespace, pod) and the series.
    alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
    rmw = [a for a in alerts if a["labels"]["alertname"] == "KeyguardSerializedRMWHotPattern"]
    assert [a["labels"]["key_pattern"] for a in rmw] in ([], ["user:{id}:profile"])  # a rate: may not fire
    assert all(a["labels"]["namespace"] == "e2e" for a in alerts)
    # SWAPDB from both tenants; the rotated password on the tenants' keyguard only.
    tenants = [a for a in alerts if a["labels"]["alertname"] == "KeyguardTenantRejectionsRising"]
    assert sorted((a["labels"]["tenant"], a["labels"]["reason"]) for a in tenants) == [("a", "tenant"), ("b", "tenant")]
    auth = [a for a in alerts if a["labels"]["alertname"] == "KeyguardUpstreamAuthFailing"]
    assert [a["labels"]["pod"] for a in auth] == ["keyguard-tenants-0"]
    # The demo workload's hygiene problems, each on its own pattern.

    def patterns(name):
        return sorted(a["labels"]["key_pattern"] for a in alerts if a["labels"]["alertname"] == name)
    assert patterns("KeyguardMissingTtlOnCachePattern") == ["cache:page:{id}"]  # session:<n> gets its EXPIRE
    assert patterns("KeyguardDelOfBigKeys") == ["feed:{id}", "report:{id}:blob"]
    hot = [a for a in alerts if a["labels"]["alertname"] == "KeyguardHotKeyPattern"]
    assert [(a["labels"]["pod"], a["labels"]["key_pattern"]) for a in hot] in ([], [("keyguard-0", "user:{id}:profile")])


def test_alerts_are_classified():
    """Every alert is either driven by this workload's counters, never expected, or timing-bound
    (each of those has a promtool test that fires it and one that does not)."""
    names = {r["alert"] for r in alert_rules()}
    assert set(QUIET_ALERTS) <= names and set(TIMING_ALERTS) <= names
    assert not set(QUIET_ALERTS) & set(TIMING_ALERTS)
    with open(ALERTS.replace("alerts.yaml", "alerts_test.yaml")) as f:
        cases = [c for t in yaml.safe_load(f)["tests"] for c in t["alert_rule_test"]]
    for name in TIMING_ALERTS:
        assert any(c["alertname"] == name and c.get("exp_alerts") for c in cases), name
        assert any(c["alertname"] == name and not c.get("exp_alerts") for c in cases), name


def test_every_metric_the_dashboards_and_alerts_use_is_exposed(stack):
    kg, _ = stack
    exposed = set(re.findall(r"^# TYPE (\w+) (\w+)", kg.metrics(), re.M))
    names = set()
    for name, kind in exposed:
        names.add(name)
        if kind == "histogram":
            names |= {name + "_bucket", name + "_sum", name + "_count"}
    used = set()
    for d in dashboards().values():
        used |= {m for _, _, e in targets(d) for m in re.findall(r"keyguard_\w+", e)}
    with open(ALERTS) as f:
        used |= set(re.findall(r"keyguard_\w+", "\n".join(r["expr"] for r in alert_rules())))
    assert used and used <= names, sorted(used - names)
