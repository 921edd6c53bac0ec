"""The container image and the compose demo, checked without a Docker engine (none in CI): the
Dockerfile's stages use the install and build scripts CI uses, the runtime stage installs exactly
the `runtime` package set and that set is what `ldd build/keyguard` needs, paths and ports agree
with the build script and the image's config, the HEALTHCHECK command works against a real
keyguard, and compose's mounts, builds and scrape targets exist and agree. The demo's TLS and
Sentinel set-ups run for real on loopback: its certificate script with the real openssl, a TLS-only
redis-server with them and a Sentinel on its sentinel.conf, each behind keyguard with the demo's
config."""
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile

import pytest
import redis
import yaml

from stack import KEYGUARD, ROOT, Keyguard, Redis, free_port, wait_port

DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
COMPOSE = os.path.join(ROOT, "docker", "compose.yaml")
# In debian:12-slim already (Essential or required by apt): not in the runtime set.
SLIM_BASE = {"libc6", "libgcc-s1", "zlib1g"}


def instructions(path=DOCKERFILE):
    """(instruction, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in open(path).read().split("\n") if not l.lstrip().startswith("#")))
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1].strip()) for l in text.split("\n") if l.strip()]


def stages():
    out, current = {}, None
    for ins, args in instructions():
        if ins == "FROM":
            image, _, name = args.partition(" AS ")
            current = name.strip()
            out[current] = {"image": image.strip(), "steps": []}
        else:
            out[current]["steps"].append((ins, args))
    return out


def package_set(name):
    text = open(os.path.join(ROOT, "scripts", "install-deps.sh")).read()
    m = re.search(r"^%s=\(([^)]*)\)" % name, text, re.M)
    return set(m.group(1).split())


def runs(stage):
    return [a for i, a in stage["steps"] if i == "RUN"]


def test_build_stage_uses_the_ci_scripts():
    s = stages()
    assert list(s) == ["build", "runtime"]
    assert s["build"]["image"] == "debian:12" and s["runtime"]["image"] == "debian:12-slim"
    build_runs = " && ".join(runs(s["build"]))
    assert "bash scripts/install-deps.sh build" in build_runs
    assert "bash scripts/build.sh release" in build_runs
    assert "apt-get" not in build_runs  # one package list: install-deps.sh


def test_runtime_stage_installs_exactly_the_runtime_set():
    rt = stages()["runtime"]
    (run,) = [r for r in runs(rt) if "install-deps.sh" in r]
    assert "install-deps.sh runtime" in run
    assert not any("apt-get install" in r for r in runs(rt))
    assert package_set("RUNTIME_PKGS")  # the script defines the set the stage asks for
    assert "runtime)" in open(os.path.join(ROOT, "scripts", "install-deps.sh")).read()


def owning_packages(libs):
    """The Debian packages that own these files (one dpkg -S call per spelling of the path: with
    merged /usr, dpkg knows some libraries by their /lib path)."""
    owners, left = set(), {os.path.realpath(l) for l in libs}
    for spell in (lambda p: p, lambda p: p.replace("/usr/lib/", "/lib/", 1)):
        if not left:
            break
        r = subprocess.run(["dpkg", "-S", *sorted(spell(p) for p in left)], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            pkg, path = line.split(": ", 1)
            owners.add(pkg.split(":")[0])
            left = {p for p in left if spell(p) != path}
    assert not left, "no package owns %s" % sorted(left)
    return owners


def test_runtime_set_is_what_the_binary_links():
    ldd = subprocess.run(["ldd", KEYGUARD], capture_output=True, text=True, check=True).stdout
    libs = re.findall(r"=> (/\S+)", ldd)
    needed = owning_packages(libs)
    runtime = package_set("RUNTIME_PKGS")
    assert needed - SLIM_BASE <= runtime, "the image would lack: %s" % sorted(needed - SLIM_BASE - runtime)
    assert runtime <= needed, "the image would install unused: %s" % sorted(runtime - needed)


def test_binary_path_and_config_agree_with_build_script_and_defaults():
    steps = stages()["runtime"]["steps"]
    copies = [a for i, a in steps if i == "COPY"]
    binary = [c for c in copies if c.startswith("--from=build")]
    assert binary == ["--from=build /src/build/keyguard /usr/local/bin/keyguard"]
    build_sh = open(os.path.join(ROOT, "scripts", "build.sh")).read()
    assert re.search(r"release\).*-B build ", build_sh)
    assert "add_executable(keyguard " in open(os.path.join(ROOT, "CMakeLists.txt")).read()
    assert ("WORKDIR", "/src") in stages()["build"]["steps"]
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    cmd = json.loads(dict(steps)["CMD"])
    assert entry == ["/usr/local/bin/keyguard"] and cmd == ["--config", "/etc/keyguard/keyguard.yaml"]
    assert "COPY docker/keyguard.yaml /etc/keyguard/keyguard.yaml" in ["COPY " + c for c in copies]
    config = yaml.safe_load(open(os.path.join(ROOT, "docker", "keyguard.yaml")))
    assert (config["listen"], config["admin"]) == ("0.0.0.0:6380", "0.0.0.0:9121")
    assert dict(steps)["EXPOSE"].split() == ["6380", "9121"]
    r = subprocess.run([KEYGUARD, "check-config", os.path.join(ROOT, "docker", "keyguard.yaml")], capture_output=True)
    assert r.returncode == 0, r.stderr


def test_runs_as_non_root():
    steps = stages()["runtime"]["steps"]
    user = [a for i, a in steps if i == "USER"]
    assert user == ["10001:10001"]
    assert "useradd --system --uid 10001" in " ".join(runs(stages()["runtime"]))
    # USER comes before the process starts: nothing after it runs as root.
    kinds = [i for i, _ in steps]
    assert kinds.index("USER") < kinds.index("ENTRYPOINT") and "RUN" not in kinds[kinds.index("USER"):]


def test_copied_sources_exist_and_are_not_docker_ignored():
    ignored = [l.strip() for l in open(os.path.join(ROOT, ".dockerignore")) if l.strip() and not l.startswith("#")]
    for stage in stages().values():
        for ins, args in stage["steps"]:
            if ins != "COPY" or args.startswith("--from"):
                continue
            src = args.split()[0]
            if src == ".":
                continue
            assert os.path.exists(os.path.join(ROOT, src)), src
            assert not any(src == i or src.startswith(i.rstrip("/") + "/") for i in ignored), src
    assert {"build", ".git"} <= set(ignored)


def healthcheck_command():
    (hc,) = [a for i, a in stages()["runtime"]["steps"] if i == "HEALTHCHECK"]
    options, _, cmd = hc.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    return json.loads(cmd)


def test_healthcheck_against_a_real_keyguard():
    cmd = healthcheck_command()
    assert "/healthz" in cmd[-1] and "/dev/tcp/127.0.0.1/9121" in cmd[-1]
    server = Redis()
    kg = Keyguard(server.port)
    try:
        ok = [c.replace("9121", str(kg.admin_port)) for c in cmd]
        r = subprocess.run(ok, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        closed = [c.replace("9121", str(free_port())) for c in cmd]
        assert subprocess.run(closed, capture_output=True, timeout=60).returncode != 0
    finally:
        assert kg.stop() == 0
        server.stop()


DEMO = os.path.join(os.path.dirname(COMPOSE), "demo")
KEYGUARDS = ["keyguard", "keyguard-tenants", "keyguard-tls", "keyguard-sentinel"]  # Prometheus's order
# The keys of the demo configs that say where the upstream is; the rest is the demo's policy.
UPSTREAM_KEYS = {"upstream", "upstream_tls", "sentinel", "upstream_auth", "tenancy", "threads"}


def compose():
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def mounts(service, named=None):
    """{path in the container: path on this machine} of a service's volumes; a named volume is
    found in `named` ({volume: directory}) or left out."""
    base, out = os.path.dirname(COMPOSE), {}
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = os.path.normpath(os.path.join(base, src))
        elif named and src in named:
            out[dst] = named[src]
    return out


def opt(args, flag):
    return args[args.index(flag) + 1]


def demo_config_text(name, services, named=None):
    """The demo config keyguard service `name` runs with, with every mounted path it names pointed
    at the file on this machine."""
    args = services[name]["command"]
    m = mounts(services[name], named)
    with open(m[opt(args, "--config")]) as f:
        text = f.read()
    for in_container, on_host in sorted(m.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(in_container, on_host)
    return text


def check_config(text):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return subprocess.run([KEYGUARD, "check-config", f.name], capture_output=True, text=True)


def make_certs(d):
    r = subprocess.run(["sh", os.path.join(DEMO, "make-certs.sh"), d], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_compose_demo_is_wired():
    c = compose()
    services = c["services"]
    assert set(services) == {"redis", "keyguard", "workload", "keyguard-tenants", "workload-tenants",
                             "certs", "redis-tls", "keyguard-tls", "workload-tls",
                             "redis-primary", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3",
                             "keyguard-sentinel", "workload-sentinel", "prometheus", "grafana"}
    base = os.path.dirname(COMPOSE)
    kg = services["keyguard"]
    assert kg["build"]["dockerfile"] == "docker/Dockerfile"
    assert os.path.isfile(os.path.join(base, kg["build"]["context"], kg["build"]["dockerfile"]))
    for name, svc in services.items():
        if "build" in svc and name != "keyguard":
            assert os.path.isfile(os.path.join(base, svc["build"]["context"], "Dockerfile")), name
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert os.path.exists(os.path.join(base, src)), (name, src)
            else:
                assert src in c["volumes"], (name, src)  # a named volume the file declares
        deps = svc.get("depends_on", [])
        for dep in deps:
            assert dep in services, (name, dep)
            # A healthy dependency has a healthcheck: its own or the image's (keyguard's HEALTHCHECK).
            if isinstance(deps, dict) and deps[dep]["condition"] == "service_healthy":
                assert "healthcheck" in services[dep] or services[dep].get("image") == kg["image"], (name, dep)
    # Each keyguard runs a demo config it mounts, with every file that config names mounted too (the
    # TLS one's CA from the certs volume, here made by the demo's script), that check-config passes.
    with tempfile.TemporaryDirectory() as certs:
        make_certs(certs)
        admin_ports = {}
        for name in KEYGUARDS:
            assert services[name]["image"] == kg["image"]
            assert services[name]["read_only"] is True and services[name]["cap_drop"] == ["ALL"]
            text = demo_config_text(name, services, {"certs": certs})
            r = check_config(text)
            assert r.returncode == 0, (name, r.stdout + r.stderr)
            for path in re.findall(r"(?m)^\s*\w+_file: (\S+)", text):
                assert os.path.isfile(path), (name, path)
            admin_ports[name] = yaml.safe_load(text)["admin"].rsplit(":", 1)[1]
            # Published: 638x for Redis clients, 912x for the admin port, a pair per keyguard.
            assert services[name]["ports"] == ["%d:6380" % (6380 + KEYGUARDS.index(name)),
                                               "%d:%s" % (9121 + KEYGUARDS.index(name), admin_ports[name])]
    for name in ("keyguard", "keyguard-tenants"):
        assert opt(services[name]["command"], "--upstream") == "redis:6379"
    # Redis has the ACL user keyguard-tenants authenticates as, with the password it reads.
    tenants_cfg = yaml.safe_load(open(os.path.join(base, "demo", "tenants.yaml")))
    password = open(os.path.join(base, "demo", "upstream-password")).read().strip()
    # (redis-server takes a directive's arguments as separate words: one "keyguard on ..." word
    # would be a user name with spaces.)
    acl = ["--user", tenants_cfg["upstream_auth"]["user"], "on", ">" + password, "~*", "&*", "+@all"]
    cmd = services["redis"]["command"]
    assert cmd[cmd.index("--user"):cmd.index("--user") + len(acl)] == acl
    # Prometheus scrapes every keyguard's admin port and loads the chart's rule file.
    prom_cfg = yaml.safe_load(open(os.path.join(base, "prometheus", "prometheus.yml")))
    (job,) = prom_cfg["scrape_configs"]
    assert [c["targets"] for c in job["static_configs"]] == [["%s:%s" % (n, p)] for n, p in admin_ports.items()]
    assert len({c["labels"]["pod"] for c in job["static_configs"]}) == len(KEYGUARDS)
    assert set(services["prometheus"]["depends_on"]) == set(KEYGUARDS)
    rules_in_container = prom_cfg["rule_files"][0]
    assert any(v.endswith(":" + rules_in_container + ":ro") and "helm/keyguard/files/prometheus/alerts.yaml" in v
               for v in services["prometheus"]["volumes"])
    r = subprocess.run(["promtool", "check", "config", "--syntax-only",
                        os.path.join(base, "prometheus", "prometheus.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Grafana: the provisioned dashboard folder is the chart's dashboards directory.
    gf = services["grafana"]["volumes"]
    provider = yaml.safe_load(open(os.path.join(base, "grafana", "provisioning", "dashboards", "keyguard.yaml")))
    path = provider["providers"][0]["options"]["path"]
    assert any(v.split(":")[1] == path and v.split(":")[0].endswith("helm/keyguard/files/dashboards") for v in gf)
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert os.path.isfile(os.path.join(ROOT, "helm/keyguard/files/dashboards", os.path.basename(home)))
    ds = yaml.safe_load(open(os.path.join(base, "grafana", "provisioning", "datasources", "prometheus.yaml")))
    assert ds["datasources"][0]["url"] == "http://prometheus:9090" and ds["datasources"][0]["type"] == "prometheus"
    # Each workload container runs the same script the e2e test runs, against its keyguard.
    for name in KEYGUARDS:
        wl = services[name.replace("keyguard", "workload")]["command"]
        assert opt(wl, "--host") == name and opt(wl, "--port") == "6380"
    assert "alice:alice-secret" in opt(services["workload-tenants"]["command"], "--tenants")
    assert "COPY workload.py" in open(os.path.join(base, "demo", "Dockerfile")).read()


def test_compose_demo_policies_are_the_demo_policy():
    """keyguard-tls and keyguard-sentinel run keyguard.yaml's policy with their own upstream: the
    same workload (which expects the demo's refusals) drives them, and the dashboards compare."""
    def policy(name):
        with open(os.path.join(DEMO, name)) as f:
            return {k: v for k, v in yaml.safe_load(f).items() if k not in UPSTREAM_KEYS}
    for name in ("keyguard-tls.yaml", "keyguard-sentinel.yaml"):
        assert policy(name) == policy("keyguard.yaml"), name


def test_compose_tls_demo_serves_a_real_round_trip():
    """The TLS set-up for real: demo/make-certs.sh run with the real openssl, redis-server with
    redis-tls's TLS arguments and those files on a loopback port (TLS only), the compose
    healthcheck against it, and keyguard with keyguard-tls's config (only the upstream address
    changed, to the loopback port: the name verified stays redis-tls) carrying an exact SET/GET.
    A server name the certificate does not carry is refused."""
    c = compose()
    services = c["services"]
    certs_svc, redis_svc, kg_svc = services["certs"], services["redis-tls"], services["keyguard-tls"]
    # The one-shot service runs the committed script from the demo image (which installs openssl)
    # into the volume redis-tls and keyguard-tls mount, and gives redis.key to the redis image's user.
    demo_image = instructions(os.path.join(DEMO, "Dockerfile"))
    assert certs_svc["build"]["context"] == "demo"
    assert any(i == "RUN" and re.search(r"apt-get install .*\bopenssl\b", a) for i, a in demo_image)
    assert certs_svc["entrypoint"] == ["sh", "/usr/local/bin/make-certs.sh"]
    assert ("COPY", "make-certs.sh /usr/local/bin/make-certs.sh") in demo_image
    (out_dir, owner) = certs_svc["command"]
    assert certs_svc["volumes"] == ["certs:" + out_dir] and certs_svc["user"] == "0:0" and owner == "999:999"
    assert redis_svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert kg_svc["depends_on"]["redis-tls"]["condition"] == "service_healthy"
    assert "--upstream" not in kg_svc["command"]  # the config's rediss:// URL is the upstream

    with tempfile.TemporaryDirectory() as certs:
        assert "redis.key" in make_certs(certs)
        assert sorted(os.listdir(certs)) == ["ca.crt", "redis.crt", "redis.key"]  # the CA key is gone
        assert os.stat(os.path.join(certs, "redis.key")).st_mode & 0o077 == 0
        before = open(os.path.join(certs, "ca.crt")).read()
        assert "kept" in make_certs(certs) and open(os.path.join(certs, "ca.crt")).read() == before

        args = redis_svc["command"]
        assert args[0] == "redis-server" and opt(args, "--port") == "0"
        in_volume = {dst: certs for dst in mounts(redis_svc, {"certs": certs})}
        (redis_dir,) = in_volume

        def local(path):
            assert os.path.dirname(path) == redis_dir, path
            return os.path.join(certs, os.path.basename(path))
        server = Redis("--tls-auth-clients", opt(args, "--tls-auth-clients"),
                       tls={"cert": local(opt(args, "--tls-cert-file")), "key": local(opt(args, "--tls-key-file")),
                            "ca": local(opt(args, "--tls-ca-cert-file"))})
        kgs = []
        try:
            # The compose healthcheck, pointed at this port.
            hc = redis_svc["healthcheck"]["test"]
            assert hc[:2] == ["CMD", "redis-cli"]
            hc = ["redis-cli", "-p", str(server.port)] + [local(a) if a.startswith(redis_dir + "/") else a for a in hc[2:]]
            r = subprocess.run(hc, capture_output=True, text=True, timeout=60)
            assert r.stdout.strip() == "PONG", r.stdout + r.stderr

            text = demo_config_text("keyguard-tls", services, {"certs": certs})
            cfg = yaml.safe_load(text)
            url = cfg["upstream"]
            assert url == "rediss://redis-tls:%s" % opt(args, "--tls-port")
            assert cfg["upstream_tls"]["server_name"] == "redis-tls" and "verify" not in cfg["upstream_tls"]
            loopback = "rediss://127.0.0.1:%d" % server.port
            kgs.append(Keyguard(server.port, config=text, threads=1, upstream=loopback))
            client = redis.Redis(port=kgs[0].port, socket_timeout=30)
            value = b"over TLS \x00\xff" * 3
            assert client.set("demo:tls", value) is True
            assert client.get("demo:tls") == value
            direct = redis.Redis(port=server.port, ssl=True, ssl_ca_certs=os.path.join(certs, "ca.crt"),
                                 ssl_check_hostname=False, socket_timeout=30)
            assert direct.get("demo:tls") == value  # it went to the TLS server
            assert kgs[0].metric("keyguard_upstream_errors_total{reason=\"tls\"}") == 0

            # The name is checked: one the certificate does not carry is refused.
            kgs.append(Keyguard(server.port, config=text.replace("server_name: redis-tls", "server_name: redis.example"),
                                threads=1, upstream=loopback))
            with pytest.raises(redis.ResponseError, match="certificate verify failed: hostname mismatch"):
                redis.Redis(port=kgs[1].port, socket_timeout=30).get("demo:tls")
        finally:
            for k in kgs:
                assert k.stop() == 0
            server.stop()


def test_compose_sentinel_demo_finds_the_primary_by_name():
    """The Sentinel set-up: the group is named by compose hostnames throughout (each server's
    replica-announce-ip and each Sentinel's announce-ip is its service name, the Sentinels resolve
    and announce names), keyguard-sentinel's URL names the three Sentinels and the group
    sentinel.conf monitors. Then for real: a Sentinel on demo/sentinel.conf (the primary's name
    and the ports changed to loopback ones) answers with a host name, and keyguard with
    keyguard-sentinel's config (the Sentinel address changed) carries an exact SET/GET to it."""
    services = compose()["services"]
    conf_path = os.path.join(DEMO, "sentinel.conf")
    with open(conf_path) as f:
        conf = [line.split() for line in f if line.strip() and not line.startswith("#")]
    directives = [" ".join(d[:2]) for d in conf]
    assert directives.index("sentinel resolve-hostnames") < directives.index("sentinel monitor")
    (monitor,) = [d for d in conf if d[:2] == ["sentinel", "monitor"]]
    master, primary_host, primary_port = monitor[2:5]
    assert ["sentinel", "resolve-hostnames", "yes"] in conf and ["sentinel", "announce-hostnames", "yes"] in conf
    (sentinel_port,) = [d[1] for d in conf if d[0] == "port"]
    for name in ("redis-primary", "redis-replica"):
        args = services[name]["command"]
        assert opt(args, "--replica-announce-ip") == name
    assert primary_host == "redis-primary" and primary_port == "6379"
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == [primary_host, primary_port]
    sentinels = ["sentinel-1", "sentinel-2", "sentinel-3"]
    for name in sentinels:
        svc = services[name]
        sh, dash_c, script = svc["command"]
        assert (sh, dash_c) == ("sh", "-c")
        # A writable copy of the mounted file (Sentinel rewrites it), made unless there is one (a
        # restarted Sentinel keeps what it learnt), run by the image's entrypoint.
        copy, run = (shlex.split(part) for part in script.replace("$$", "$").split(";"))
        assert len(copy) == 7 and copy[:2] == ["test", "-e"] and copy[3:5] == ["||", "cp"]
        assert mounts(svc)[copy[5]] == conf_path and copy[6] == copy[2]
        assert run[:4] == ["exec", "docker-entrypoint.sh", "redis-server", copy[2]]
        assert run[4:] == ["--sentinel", "--sentinel", "announce-ip", "$SENTINEL_NAME"]
        assert svc["environment"] == {"SENTINEL_NAME": name}
        assert services["keyguard-sentinel"]["depends_on"][name]["condition"] == "service_healthy"
        assert "ckquorum " + master in svc["healthcheck"]["test"][1]
    text = demo_config_text("keyguard-sentinel", services)
    url = yaml.safe_load(text)["upstream"]
    assert url == "redis-sentinel://%s@%s" % (master, ",".join("%s:%s" % (s, sentinel_port) for s in sentinels))
    assert "--upstream" not in services["keyguard-sentinel"]["command"]

    # For real, on loopback, with "localhost" for the compose names: redis-primary's arguments, and
    # sentinel-1's own command (sh -c, with a stand-in for the image's entrypoint) running a copy of
    # sentinel.conf whose primary and port are loopback ones.
    local = {name: "localhost" for name in services}
    primary = Redis(*[local.get(a, a) for a in services["redis-primary"]["command"][1:]])
    d = tempfile.mkdtemp(prefix="kg-demo-sentinel-")
    with open(conf_path) as f:
        text_conf = f.read()
    port = free_port()
    text_conf = text_conf.replace("monitor %s %s %s" % (master, primary_host, primary_port),
                                  "monitor %s localhost %d" % (master, primary.port))
    text_conf = text_conf.replace("port %s\n" % sentinel_port, "port %d\nbind 127.0.0.1\n" % port)
    mounted, data, bin_dir = (os.path.join(d, x) for x in ("sentinel.conf", "data", "bin"))
    with open(mounted, "w") as f:
        f.write(text_conf)
    os.mkdir(data)
    os.mkdir(bin_dir)
    with open(os.path.join(bin_dir, "docker-entrypoint.sh"), "w") as f:
        f.write('#!/bin/sh\nexec "$@"\n')
    os.chmod(os.path.join(bin_dir, "docker-entrypoint.sh"), 0o755)
    sh, dash_c, script = services["sentinel-1"]["command"]
    script = script.replace("$$", "$").replace(copy[5], mounted).replace(copy[2], os.path.join(data, "sentinel.conf"))
    log = tempfile.TemporaryFile()
    sentinel = subprocess.Popen([sh, dash_c, script], cwd=data, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PATH=bin_dir + ":" + os.environ["PATH"], SENTINEL_NAME="localhost"))
    kg = None
    try:
        wait_port(port, proc=sentinel)
        asked = redis.Redis(port=port, decode_responses=True).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", master)
        assert list(asked) == ["localhost", str(primary.port)]  # a name, not an address
        kg = Keyguard(primary.port, config=text, threads=1,
                      upstream="redis-sentinel://%s@127.0.0.1:%d" % (master, port))
        client = redis.Redis(port=kg.port, socket_timeout=30)
        assert client.set("demo:sentinel", "primary") is True
        assert client.get("demo:sentinel") == b"primary"
        assert redis.Redis(port=primary.port).get("demo:sentinel") == b"primary"
        # It ran on the copy, which it rewrote, and announces the name it was given.
        with open(os.path.join(data, "sentinel.conf")) as f:
            assert 'sentinel announce-ip "localhost"' in f.read()
        with open(mounted) as f:
            assert f.read() == text_conf
    finally:
        if kg is not None:
            assert kg.stop() == 0
        sentinel.terminate()
        sentinel.wait(60)
        primary.stop()
        log.seek(0)
        print(log.read().decode(errors="replace")[-2000:])
        shutil.rmtree(d, ignore_errors=True)
