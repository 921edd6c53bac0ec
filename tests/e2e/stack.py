"""Processes for the end-to-end tests: redis-server and keyguard come from the integration
fixtures (tests/integration/conftest.py, loaded under another module name so that pytest's own
conftest handling is not disturbed), Prometheus from Debian's package."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "tests", "integration"))  # the fixtures' own imports (resp)
_spec = importlib.util.spec_from_file_location("keyguard_fixtures",
                                               os.path.join(ROOT, "tests", "integration", "conftest.py"))
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

Redis, Keyguard, free_port, wait_port, KEYGUARD = (fixtures.Redis, fixtures.Keyguard, fixtures.free_port,
                                                    fixtures.wait_port, fixtures.KEYGUARD)
PATIENCE = fixtures.PATIENCE
CHART = os.path.join(ROOT, "helm", "keyguard")
DASHBOARDS = os.path.join(CHART, "files", "dashboards")
ALERTS = os.path.join(CHART, "files", "prometheus", "alerts.yaml")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, with python3-redis


class Prometheus:
    """A real Prometheus scraping `targets` ({"HOST:PORT": {label: value}}) every second and
    evaluating `rule_files` every second, with its storage in a temporary directory."""

    def __init__(self, targets, rule_files=()):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kg-prom-")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": list(rule_files),
            "scrape_configs": [{"job_name": "keyguard", "static_configs": [
                {"targets": [target], "labels": labels} for target, labels in targets.items()]}],
        }
        path = os.path.join(self.dir, "prometheus.yml")
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w+")
        self.proc = subprocess.Popen(
            ["/usr/bin/prometheus", "--config.file", path, "--storage.tsdb.path", os.path.join(self.dir, "data"),
             "--web.listen-address", "127.0.0.1:%d" % self.port, "--storage.tsdb.retention.time", "1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, proc=self.proc)
        deadline = time.time() + PATIENCE
        while self.get("/-/ready", raw=True) != 200:
            if time.time() > deadline:
                raise RuntimeError("prometheus not ready:\n" + self.output())
            time.sleep(0.1)

    def get(self, path, raw=False, **params):
        url = "http://127.0.0.1:%d%s" % (self.port, path)
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=PATIENCE) as r:
                return r.status if raw else json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            return e.code if raw else json.loads(e.read().decode())
        except OSError:
            if raw:
                return 0
            raise

    def query(self, expr):
        """An instant query now: the API's whole answer ({"status": ..., "data" or "error": ...})."""
        return self.get("/api/v1/query", query=expr)

    def value(self, expr):
        """The sum of the values of an instant query's series (0 with none)."""
        r = self.query(expr)
        assert r["status"] == "success", (expr, r)
        return sum(float(s["value"][1]) for s in r["data"]["result"])

    def wait_for(self, expr, predicate, timeout=PATIENCE):
        deadline = time.time() + timeout
        while True:
            v = self.value(expr)
            if predicate(v):
                return v
            if time.time() > deadline:
                raise AssertionError("%s stayed at %s" % (expr, v))
            time.sleep(0.2)

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(PATIENCE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
