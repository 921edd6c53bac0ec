"""Renders helm/keyguard (and the example app chart that runs it as a sidecar) without a helm
binary: tests/e2e/helmrender is a small Go program with Helm's template engine (text/template +
sprig + include/tpl/required/toYaml/fromYaml/.Files), built from Debian's Go packages. Every
rendering must parse as YAML, pass yamllint, and hold what the values promise: modes, probes,
security context, the ConfigMap keyguard reloads (its keyguard.yaml passes `keyguard
check-config` with the files the pod mounts from Secrets: upstream password, tenants' users),
the Secrets (no credential in a ConfigMap), TLS Secrets mounted for the upstream and the listener,
the Sentinel credentials, monitors, the PrometheusRule (equal to the rule file) and the
dashboard ConfigMaps (equal to the JSON files). NOTES.txt, as `helm install` prints it, says what
upstream keyguard fronts (no credential) and how clients reach it: plain, or with TLS (rediss://,
redis-cli --tls) in standalone and sidecar mode."""
import base64
import hashlib
import json
import os
import subprocess
import tempfile

import pytest
import yaml

from stack import ALERTS, CHART, DASHBOARDS, KEYGUARD, ROOT

EXAMPLE = os.path.join(ROOT, "helm", "examples", "app-with-keyguard")
UPSTREAM_PASSWORD = "/var/run/secrets/keyguard/upstream/password"
USERS_FILE = "/var/run/secrets/keyguard/tenants/users.yaml"
# Rendered output: toYaml writes block sequences unindented, the templates indent theirs, as Helm.
RENDERED_LINT = ("{extends: default, rules: {line-length: disable, document-start: disable, "
                 "indentation: {indent-sequences: whatever}, truthy: {check-keys: false}}}")


@pytest.fixture(scope="module")
def helmrender():
    out = tempfile.mkdtemp(prefix="kg-helmrender-")
    env = dict(os.environ, GO111MODULE="off", GOPATH="/usr/share/gocode", GOFLAGS="",
               GOCACHE=os.path.join(ROOT, "build", "go-cache"))
    binary = os.path.join(out, "helmrender")
    subprocess.run(["go", "build", "-o", binary, "."], cwd=os.path.join(ROOT, "tests", "e2e", "helmrender"),
                   env=env, check=True)
    return binary


def render(helmrender, values=None, chart=CHART, subchart=False, expect_error=None):
    args = [helmrender, "-chart", chart, "-release", "shop", "-namespace", "prod"]
    if subchart:
        args += ["-subchart", "keyguard=" + CHART]
    if values is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            json.dump(values, f)
        args += ["-f", f.name]
    r = subprocess.run(args, capture_output=True, text=True)
    if expect_error:
        assert r.returncode != 0 and expect_error in r.stderr, (r.returncode, r.stderr)
        return None
    assert r.returncode == 0, r.stderr
    lint = subprocess.run(["yamllint", "-d", RENDERED_LINT, "-"], input=r.stdout, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + r.stdout
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    by_kind = {}
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        by_kind.setdefault(d["kind"], []).append(d)
    return by_kind


def one(by_kind, kind):
    assert len(by_kind.get(kind, [])) == 1, (kind, sorted(by_kind))
    return by_kind[kind][0]


def arg(container, flag):
    a = container["args"]
    return a[a.index(flag) + 1]


def check_container(c, listen):
    assert arg(c, "--config") == "/etc/keyguard/keyguard.yaml"
    assert arg(c, "--listen") == listen
    assert arg(c, "--admin") == "0.0.0.0:9121"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"keyguard-redis": 6380, "keyguard-admin": 9121}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "keyguard-admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "keyguard-admin"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    # A directory mount: a subPath mount would never see ConfigMap updates, and keyguard reloads them.
    mount = next(m for m in c["volumeMounts"] if m["name"] == "keyguard-config")
    assert mount["mountPath"] == "/etc/keyguard" and "subPath" not in mount


def mounted_secret_files(pod_spec, container, secrets):
    """{path in the container: bytes} for every Secret volume the container mounts, read from the
    rendered Secrets or, for one the chart does not render (existingSecret), from `secrets`
    ({name: {key: text}})."""
    rendered = {name: {k: base64.b64decode(v) for k, v in data.items()} for name, data in secrets.items()}
    files = {}
    for vol in pod_spec["volumes"]:
        if "secret" not in vol:
            continue
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == vol["name"]]
        data = rendered[vol["secret"]["secretName"]]
        for item in vol["secret"]["items"]:
            files[os.path.join(mount["mountPath"], item["path"])] = data[item["key"]]
    return files


def check_config_map(cm, files=None):
    """keyguard check-config accepts the rendered keyguard.yaml, with the files the pod mounts
    (`files`, {path: bytes}) written to a temporary directory and the config's paths to them
    pointed there."""
    text = cm["data"]["keyguard.yaml"]
    with tempfile.TemporaryDirectory() as d:
        for i, (path, data) in enumerate(sorted((files or {}).items())):
            assert path in text, (path, text)  # the config names every mounted file
            local = os.path.join(d, "%d-%s" % (i, os.path.basename(path)))
            with open(local, "wb") as f:
                f.write(data)
            text = text.replace(path, local)
        config = os.path.join(d, "keyguard.yaml")
        with open(config, "w") as f:
            f.write(text)
        r = subprocess.run([KEYGUARD, "check-config", config], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_tag_is_the_app_version():
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    with open(os.path.join(CHART, "values.yaml")) as f:
        values = yaml.safe_load(f)
    assert values["image"]["tag"] == chart["appVersion"]


def test_lint_hand_written_yaml():
    # Paths relative to the root: .yamllint's per-rule ignore patterns are anchored there.
    files = ["helm/keyguard/values.yaml", "helm/keyguard/Chart.yaml", "helm/keyguard/files/prometheus",
             "helm/examples/app-with-keyguard/values.yaml", "helm/examples/app-with-keyguard/Chart.yaml", "docker",
             ".yamllint"]
    r = subprocess.run(["yamllint", "-s", *files], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_standalone_defaults(helmrender):
    k = render(helmrender)
    assert sorted(k) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]
    dep, svc, pdb, cm = (one(k, x) for x in ("Deployment", "Service", "PodDisruptionBudget", "ConfigMap"))
    assert dep["metadata"]["name"] == "shop-keyguard" and dep["metadata"]["namespace"] == "prod"
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    check_container(c, "0.0.0.0:6380")
    assert arg(c, "--upstream") == "redis:6379" and c["image"] == "keyguard:0.1.0"
    assert "lifecycle" not in c and "restartPolicy" not in c
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["terminationGracePeriodSeconds"] > 10  # drain_timeout_ms defaults to 10 s
    selector = dep["spec"]["selector"]["matchLabels"]
    labels = pod["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert svc["spec"]["selector"] == selector and pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "redis": (6380, "keyguard-redis"), "admin": (9121, "keyguard-admin")}
    (vol,) = pod["spec"]["volumes"]
    assert vol == {"name": "keyguard-config", "configMap": {"name": cm["metadata"]["name"]}}
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {"key_policy": {"default_action": "observe"}}
    check_config_map(cm)


def test_standalone_with_everything_on(helmrender):
    values = {
        "upstream": "redis-master.data.svc:6379", "threads": 2, "extraArgs": ["--version"],
        "config": {"deny_commands": ["FLUSHALL"], "key_policy": {"default_action": "warn"}},
        "upstreamAuth": {"username": "kg", "password": "s3cret"},
        "standalone": {"podDisruptionBudget": {"maxUnavailable": 1}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                    "podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True, "labels": {"release": "kps"}}},
        "dashboards": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "keyguard"}},
    }
    k = render(helmrender, values)
    assert sorted(k) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "Secret",
                         "Service", "ServiceMonitor"]
    dep, svc = one(k, "Deployment"), one(k, "Service")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    check_container(c, "0.0.0.0:6380")
    assert arg(c, "--upstream") == "redis-master.data.svc:6379" and arg(c, "--threads") == "2"
    assert c["args"][-1] == "--version"
    assert one(k, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1

    secret = one(k, "Secret")
    assert {x: base64.b64decode(v).decode() for x, v in secret["data"].items()} == {"password": "s3cret"}
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "keyguard-upstream")
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    assert {"name": "keyguard-upstream", "mountPath": "/var/run/secrets/keyguard/upstream",
            "readOnly": True} in c["volumeMounts"]
    files = mounted_secret_files(pod["spec"], c, {secret["metadata"]["name"]: secret["data"]})
    assert files == {UPSTREAM_PASSWORD: b"s3cret"}

    sm = one(k, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in svc["spec"]["ports"]]
    pm = one(k, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in [p["name"] for p in c["ports"]]

    rule = one(k, "PrometheusRule")
    with open(ALERTS) as f:
        assert rule["spec"]["groups"] == yaml.safe_load(f)["groups"]
    assert rule["metadata"]["labels"]["release"] == "kps"

    cms = {cm["metadata"]["name"]: cm for cm in k["ConfigMap"]}
    assert yaml.safe_load(cms["shop-keyguard-config"]["data"]["keyguard.yaml"])["upstream_auth"] == {
        "user": "kg", "password_file": UPSTREAM_PASSWORD}
    check_config_map(cms["shop-keyguard-config"], files)
    boards = {n: cm for n, cm in cms.items() if "dashboard" in n}
    assert sorted(boards) == ["shop-keyguard-dashboard-keyguard-hygiene", "shop-keyguard-dashboard-keyguard-proxy"]
    for cm in boards.values():
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "keyguard"}
        ((name, text),) = cm["data"].items()
        with open(os.path.join(DASHBOARDS, name)) as f:
            assert json.loads(text) == json.load(f)


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def pod_and_container(k):
    pod = one(k, "Deployment")["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    return pod, c


TENANT_USERS = [
    {"name": "alice", "password": "alice-secret", "prefix": "tenant:a:", "tenant": "a"},
    {"name": "bob", "password_sha256": sha256("bob-secret"), "prefix": "tenant:b:"},
]


def test_tenant_users_and_upstream_password_go_into_secrets_the_config_names(helmrender):
    values = {"upstreamAuth": {"username": "keyguard", "password": "upstream-pw"},
              "tenancy": {"users": TENANT_USERS},
              "config": {"tenancy": {"flush": "refuse"}, "key_policy": {"default_action": "warn"}}}
    k = render(helmrender, values)
    assert sorted(k) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
    secrets = {s["metadata"]["name"]: s for s in k["Secret"]}
    assert sorted(secrets) == ["shop-keyguard-tenants", "shop-keyguard-upstream"]
    cm = one(k, "ConfigMap")
    # No credential reaches the ConfigMap: it names the mounted files.
    for secret in ("alice-secret", "upstream-pw", sha256("alice-secret"), sha256("bob-secret")):
        assert secret not in json.dumps(cm), secret
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {
        "key_policy": {"default_action": "warn"},
        "tenancy": {"flush": "refuse", "users_file": USERS_FILE},
        "upstream_auth": {"user": "keyguard", "password_file": UPSTREAM_PASSWORD}}
    # The chart keeps only the SHA-256 of each password.
    users = yaml.safe_load(base64.b64decode(secrets["shop-keyguard-tenants"]["data"]["users.yaml"]))
    assert users == {"users": [
        {"name": "alice", "password_sha256": sha256("alice-secret"), "prefix": "tenant:a:", "tenant": "a"},
        {"name": "bob", "password_sha256": sha256("bob-secret"), "prefix": "tenant:b:"}]}
    pod, c = pod_and_container(k)
    check_container(c, "0.0.0.0:6380")
    assert {"name": "keyguard-tenants", "mountPath": "/var/run/secrets/keyguard/tenants",
            "readOnly": True} in c["volumeMounts"]
    files = mounted_secret_files(pod["spec"], c, {n: s["data"] for n, s in secrets.items()})
    assert sorted(files) == sorted([UPSTREAM_PASSWORD, USERS_FILE]) and files[UPSTREAM_PASSWORD] == b"upstream-pw"
    check_config_map(cm, files)

    # tenancy and upstream_auth are read at start: changing them rolls the pods, a policy change
    # (reloaded in place) does not.
    def checksum(v):
        return pod_and_container(render(helmrender, v))[0]["metadata"]["annotations"]["checksum/keyguard"]
    base = checksum(values)
    assert checksum(dict(values, config={"key_policy": {"default_action": "observe"}, "tenancy": {"flush": "refuse"}})) == base
    assert checksum(dict(values, tenancy={"users": TENANT_USERS[:1]})) != base
    assert checksum(dict(values, upstreamAuth={"password": "rotated"})) != base


def test_existing_secrets_for_users_and_upstream_password(helmrender):
    k = render(helmrender, {
        "upstreamAuth": {"existingSecret": "redis-creds", "passwordKey": "redis-password"},
        "tenancy": {"existingSecret": "shop-tenants", "usersKey": "tenants.yaml"}})
    assert "Secret" not in k
    pod, c = pod_and_container(k)
    vols = {v["name"]: v["secret"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert vols == {"keyguard-upstream": {"secretName": "redis-creds",
                                          "items": [{"key": "redis-password", "path": "password"}]},
                    "keyguard-tenants": {"secretName": "shop-tenants",
                                         "items": [{"key": "tenants.yaml", "path": "users.yaml"}]}}
    cm = one(k, "ConfigMap")
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {
        "key_policy": {"default_action": "observe"}, "tenancy": {"users_file": USERS_FILE},
        "upstream_auth": {"password_file": UPSTREAM_PASSWORD}}
    existing = {"redis-creds": {"redis-password": base64.b64encode(b"pw\n")},
                "shop-tenants": {"tenants.yaml": base64.b64encode(
                    yaml.safe_dump({"users": TENANT_USERS}).encode())}}  # plain passwords are allowed there
    check_config_map(cm, mounted_secret_files(pod["spec"], c, existing))


UPSTREAM_TLS = "/var/run/secrets/keyguard/upstream-tls"
LISTEN_TLS = "/var/run/secrets/keyguard/listen-tls"
SENTINEL_PASSWORD = "/var/run/secrets/keyguard/sentinel/password"


def test_managed_redis_over_tls_with_a_tls_listener(helmrender):
    """The first set-up of docs/operations.md: a managed Redis over TLS (CA and client certificate
    from a Secret), keyguard's own listener serving TLS with client certificates required."""
    values = {"upstream": "rediss://keyguard@redis.example.com:6380",
              "upstreamTls": {"existingSecret": "redis-tls", "certKey": "tls.crt", "keyKey": "tls.key",
                              "serverName": "redis.example.com", "minVersion": "1.3"},
              "upstreamAuth": {"existingSecret": "redis-creds"},
              "listenTls": {"enabled": True, "existingSecret": "keyguard-tls", "caKey": "ca.crt",
                            "requireClientCert": True},
              "config": {"upstream_tls": {"ciphersuites": "TLS_AES_256_GCM_SHA384"}}}
    k = render(helmrender, values)
    assert "Secret" not in k  # certificates and keys stay in the Secrets the cluster has
    pod, c = pod_and_container(k)
    check_container(c, "0.0.0.0:6380")
    assert arg(c, "--upstream") == "rediss://keyguard@redis.example.com:6380"
    vols = {v["name"]: v["secret"] for v in pod["spec"]["volumes"] if "secret" in v}
    # Whole files by key, no subPath: a rotated Secret reaches the files and keyguard reloads them.
    assert vols == {
        "keyguard-upstream": {"secretName": "redis-creds", "items": [{"key": "password", "path": "password"}]},
        "keyguard-upstream-tls": {"secretName": "redis-tls", "items": [
            {"key": "ca.crt", "path": "ca.crt"}, {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"}]},
        "keyguard-listen-tls": {"secretName": "keyguard-tls", "items": [
            {"key": "ca.crt", "path": "ca.crt"}, {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"}]}}
    for name, path in (("keyguard-upstream-tls", UPSTREAM_TLS), ("keyguard-listen-tls", LISTEN_TLS)):
        assert {"name": name, "mountPath": path, "readOnly": True} in c["volumeMounts"]
    assert all("subPath" not in m for m in c["volumeMounts"])
    cm = one(k, "ConfigMap")
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {
        "key_policy": {"default_action": "observe"},
        "upstream_auth": {"password_file": UPSTREAM_PASSWORD},
        "upstream_tls": {"ca_file": UPSTREAM_TLS + "/ca.crt", "cert_file": UPSTREAM_TLS + "/tls.crt",
                         "key_file": UPSTREAM_TLS + "/tls.key", "server_name": "redis.example.com",
                         "min_version": "1.3", "ciphersuites": "TLS_AES_256_GCM_SHA384"},
        "listen_tls": {"ca_file": LISTEN_TLS + "/ca.crt", "cert_file": LISTEN_TLS + "/tls.crt",
                       "key_file": LISTEN_TLS + "/tls.key", "require_client_cert": True}}
    pem = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n")
    existing = {"redis-creds": {"password": base64.b64encode(b"pw\n")},
                "redis-tls": {"ca.crt": pem, "tls.crt": pem, "tls.key": pem},
                "keyguard-tls": {"ca.crt": pem, "tls.crt": pem, "tls.key": pem}}
    files = mounted_secret_files(pod["spec"], c, existing)
    assert len(files) == 7
    check_config_map(cm, files)
    # The TLS settings are read at start (the files' contents reload by themselves): they roll the pods.
    def checksum(v):
        return pod_and_container(render(helmrender, v))[0]["metadata"]["annotations"]["checksum/keyguard"]
    assert checksum(dict(values, listenTls=dict(values["listenTls"], requireClientCert=False))) != checksum(values)


def test_sentinel_group_upstream(helmrender):
    """The second set-up: the primary of a Sentinel group, with credentials for the Sentinels and
    for Redis, each password in its own Secret."""
    values = {"upstream": "redis-sentinel://mymaster@redis-sentinel-0.redis:26379,redis-sentinel-1.redis:26379",
              "sentinel": {"username": "keyguard", "password": "sentinel-pw"},
              "upstreamAuth": {"password": "redis-pw"}}
    k = render(helmrender, values)
    secrets = {s["metadata"]["name"]: s for s in k["Secret"]}
    assert {n: {x: base64.b64decode(v) for x, v in s["data"].items()} for n, s in secrets.items()} == {
        "shop-keyguard-upstream": {"password": b"redis-pw"}, "shop-keyguard-sentinel": {"password": b"sentinel-pw"}}
    pod, c = pod_and_container(k)
    assert arg(c, "--upstream") == values["upstream"]
    cm = one(k, "ConfigMap")
    assert "sentinel-pw" not in json.dumps(cm)
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {
        "key_policy": {"default_action": "observe"},
        "upstream_auth": {"password_file": UPSTREAM_PASSWORD},
        "sentinel": {"user": "keyguard", "password_file": SENTINEL_PASSWORD}}
    files = mounted_secret_files(pod["spec"], c, {n: s["data"] for n, s in secrets.items()})
    assert files == {UPSTREAM_PASSWORD: b"redis-pw", SENTINEL_PASSWORD: b"sentinel-pw"}
    check_config_map(cm, files)


def test_static_tenant(helmrender):
    k = render(helmrender, {"tenancy": {"prefix": "shop:", "name": "shop"}})
    assert "Secret" not in k
    pod, _ = pod_and_container(k)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["keyguard-config"]
    cm = one(k, "ConfigMap")
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {
        "key_policy": {"default_action": "observe"}, "tenancy": {"prefix": "shop:", "name": "shop"}}
    check_config_map(cm)


def test_sidecar_mode_renders_config_and_monitoring_but_no_workload(helmrender):
    k = render(helmrender, {"mode": "sidecar", "metrics": {"podMonitor": {
        "enabled": True, "selector": {"matchLabels": {"app": "shop-api"}}}}})
    assert sorted(k) == ["ConfigMap", "PodMonitor"]
    assert one(k, "PodMonitor")["spec"]["selector"] == {"matchLabels": {"app": "shop-api"}}
    render(helmrender, {"mode": "sidecar", "metrics": {"podMonitor": {"enabled": True}}},
           expect_error="metrics.podMonitor.selector")


def test_bad_values_fail_with_the_field(helmrender):
    render(helmrender, {"mode": "daemonset"}, expect_error='mode: must be standalone or sidecar, not "daemonset"')
    render(helmrender, {"upstream": ""}, expect_error="upstream: the Redis address")
    render(helmrender, {"config": {"tenancy": {"users": TENANT_USERS}}}, expect_error="config.tenancy.users: list users")
    render(helmrender, {"config": {"upstream_auth": {"password": "x"}}}, expect_error="config.upstream_auth: set")
    render(helmrender, {"upstreamAuth": {"usernameKey": "username", "password": "x"}},
           expect_error="upstreamAuth.usernameKey: keyguard takes")
    render(helmrender, {"upstreamAuth": {"username": "kg"}}, expect_error="upstreamAuth.username: needs")
    render(helmrender, {"tenancy": {"prefix": "a:", "users": TENANT_USERS}}, expect_error="tenancy.prefix: static")
    render(helmrender, {"tenancy": {"name": "a"}}, expect_error="tenancy.name: needs tenancy.prefix")
    render(helmrender, {"tenancy": {"users": [{"name": "eve", "prefix": "e:"}]}},
           expect_error="tenancy.users[0]: needs password or password_sha256")
    render(helmrender, {"upstreamTls": {"existingSecret": "redis-tls"}},
           expect_error='upstreamTls: set, but upstream "redis:6379" is not TLS')
    render(helmrender, {"upstream": "rediss://r:6380", "upstreamTls": {"existingSecret": "t", "certKey": "tls.crt"}},
           expect_error="upstreamTls.certKey and upstreamTls.keyKey go together")
    render(helmrender, {"sentinel": {"password": "x"}},
           expect_error='sentinel: set, but upstream "redis:6379" is not a Sentinel group')
    render(helmrender, {"upstream": "redis-sentinel://m@s:26379", "sentinel": {"username": "kg"}},
           expect_error="sentinel.username: needs sentinel.password")
    render(helmrender, {"config": {"sentinel": {"password_file": "/x"}}}, expect_error="config.sentinel: set")
    render(helmrender, {"listenTls": {"enabled": True}}, expect_error="listenTls.existingSecret: required")
    render(helmrender, {"listenTls": {"existingSecret": "t"}}, expect_error="listenTls: set, but listenTls.enabled")
    render(helmrender, {"listenTls": {"enabled": True, "existingSecret": "t", "requireClientCert": True}},
           expect_error="listenTls.requireClientCert: needs listenTls.caKey")


@pytest.mark.parametrize("native", [True, False])
def test_app_chart_with_keyguard_sidecar(helmrender, native):
    k = render(helmrender, {"keyguard": {"sidecar": {"nativeSidecar": native}}}, chart=EXAMPLE, subchart=True)
    assert sorted(k) == ["ConfigMap", "Deployment", "PodMonitor"]
    template = one(k, "Deployment")["spec"]["template"]
    assert len(template["metadata"]["annotations"]["checksum/keyguard"]) == 64
    spec = template["spec"]
    if native:
        # A native sidecar: an init container that keeps running, started and probed before the app.
        (kg,) = spec["initContainers"]
        assert kg["restartPolicy"] == "Always" and kg["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert "lifecycle" not in kg
        assert [c["name"] for c in spec["containers"]] == ["app"]
    else:
        assert "initContainers" not in spec
        app, kg = spec["containers"]
        assert "restartPolicy" not in kg and "startupProbe" not in kg
        assert kg["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert kg["name"] == "keyguard"
    check_container(kg, "127.0.0.1:6380")
    assert arg(kg, "--upstream") == "redis-master.data.svc:6379"
    app = next(c for c in spec["containers"] if c["name"] == "app")
    assert {"name": "REDIS_ADDR", "value": "127.0.0.1:6380"} in app["env"]
    # The pod mounts the ConfigMap the keyguard subchart renders.
    cm = one(k, "ConfigMap")
    (vol,) = spec["volumes"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"] == "shop-keyguard-config"
    assert yaml.safe_load(cm["data"]["keyguard.yaml"]) == {"key_policy": {"default_action": "warn"}}
    check_config_map(cm)
    pm = one(k, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == one(k, "Deployment")["spec"]["selector"]["matchLabels"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in [p["name"] for p in kg["ports"]]


def notes(helmrender, values):
    """NOTES.txt as `helm install` would print it for these values (whose manifests must render and
    lint too)."""
    render(helmrender, values)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        json.dump(values, f)
        f.flush()
        r = subprocess.run([helmrender, "-chart", CHART, "-release", "shop", "-namespace", "prod", "-f", f.name],
                           env=dict(os.environ, HELMRENDER_NOTES="1"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("# Source: keyguard/templates/NOTES.txt\n", 1)[1].split("\n---\n")[0]


POLICY_NOTE = "Policy changes: edit the ConfigMap; keyguard reloads it within seconds (see /config on the admin port)."


@pytest.mark.parametrize("mode,expect", [
    ("standalone", ["keyguard fronts redis:6379", "Point Redis clients at:", "  shop-keyguard.prod.svc:6380",
                    "Metrics: http://shop-keyguard.prod.svc:9121/metrics", POLICY_NOTE]),
    ("sidecar", ["keyguard fronts redis:6379", "Sidecar mode: this release holds keyguard's config (shop-keyguard-config).",
                 "Add keyguard to your app's pods with the keyguard.sidecar.* templates (helm/keyguard/README.md)",
                 "and point the app at 127.0.0.1:6380.", POLICY_NOTE])])
def test_notes_plain_tcp(helmrender, mode, expect):
    assert notes(helmrender, {"mode": mode}).split("\n") == expect


def test_notes_tls_listener_and_managed_redis_over_tls(helmrender):
    """Standalone with listenTls: the TLS address and redis-cli --tls in place of the plain one;
    the upstream over TLS with where its trust comes from, and no credential."""
    values = {"upstream": "rediss://keyguard@redis.example.com:6380",
              "upstreamTls": {"existingSecret": "redis-tls", "serverName": "redis.example.com", "minVersion": "1.3"},
              "upstreamAuth": {"username": "kg", "password": "s3cret-upstream"},
              "listenTls": {"enabled": True, "existingSecret": "keyguard-tls", "caKey": "ca.crt",
                            "requireClientCert": True}}
    text = notes(helmrender, values)
    assert "s3cret-upstream" not in text
    assert text.split("\n") == [
        "keyguard fronts rediss://keyguard@redis.example.com:6380",
        "  over TLS: their certificates must chain to the CA in Secret redis-tls (ca.crt)",
        "  and name redis.example.com; TLS 1.3 or later",
        "  AUTH to Redis as kg, password from Secret shop-keyguard-upstream",
        "Clients connect with TLS (keyguard's certificate from Secret keyguard-tls):",
        "  rediss://shop-keyguard.prod.svc:6380",
        "  redis-cli --tls --cacert ca.crt -h shop-keyguard.prod.svc -p 6380 --cert client.crt --key client.key",
        "  A client certificate signed by the CA in Secret keyguard-tls (ca.crt) is required.",
        "Metrics: http://shop-keyguard.prod.svc:9121/metrics",
        POLICY_NOTE]
    # Without client certificates: no --cert in the example, and no plain address anywhere.
    text = notes(helmrender, dict(values, listenTls={"enabled": True, "existingSecret": "keyguard-tls"},
                                  upstreamTls={}, upstream="redis:6379", upstreamAuth={}))
    assert "  redis-cli --tls --cacert ca.crt -h shop-keyguard.prod.svc -p 6380\n" in text
    assert "Point Redis clients at" not in text and "client certificate" not in text
    assert "over TLS" not in text.split("Clients connect")[0]


def test_notes_sidecar_with_tls_in_front_of_a_sentinel_group(helmrender):
    values = {"mode": "sidecar", "upstream": "rediss-sentinel://mymaster@s-0.redis:26379,s-1.redis:26379",
              "sentinel": {"username": "keyguard", "password": "sentinel-pw"},
              "upstreamTls": {"existingSecret": "redis-tls", "certKey": "tls.crt", "keyKey": "tls.key"},
              "listenTls": {"enabled": True, "existingSecret": "kg-tls", "caKey": "ca.crt"}}
    text = notes(helmrender, values)
    assert "sentinel-pw" not in text
    assert text.split("\n") == [
        "keyguard fronts rediss-sentinel://mymaster@s-0.redis:26379,s-1.redis:26379",
        "  the primary of Sentinel group mymaster, asked of the Sentinels s-0.redis:26379, s-1.redis:26379;",
        "  keyguard follows it across failovers (AUTH to the Sentinels as keyguard, password from Secret "
        "shop-keyguard-sentinel)",
        "  over TLS to the Sentinels and the servers: their certificates must chain to the CA in Secret redis-tls "
        "(ca.crt)",
        "  and name the host keyguard connects to; keyguard's client certificate from Secret redis-tls (tls.crt)",
        "Sidecar mode: this release holds keyguard's config (shop-keyguard-config).",
        "Add keyguard to your app's pods with the keyguard.sidecar.* templates (helm/keyguard/README.md)",
        "and point the app at rediss://127.0.0.1:6380: it connects with TLS (keyguard's certificate from",
        "Secret kg-tls, which must name what the app checks: 127.0.0.1 or the server name it sends).",
        "  redis-cli --tls --cacert ca.crt -h 127.0.0.1 -p 6380 --cert client.crt --key client.key",
        "  A client certificate, when given, must be signed by the CA in Secret kg-tls (ca.crt).",
        POLICY_NOTE]
    # A plain Sentinel group: no TLS line.
    text = notes(helmrender, {"upstream": "redis-sentinel://mymaster@s-0.redis:26379"})
    assert "  the primary of Sentinel group mymaster, asked of the Sentinels s-0.redis:26379;\n" in text
    assert "TLS" not in text and "AUTH" not in text


def test_notes_never_repeat_a_password_in_the_url(helmrender):
    # keyguard refuses such a URL at start; NOTES do not print the password meanwhile.
    text = notes(helmrender, {"upstream": "redis://app:hunter2@redis:6379"})
    assert "hunter2" not in text and text.startswith("keyguard fronts redis://app:***@redis:6379\n")
