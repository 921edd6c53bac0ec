"""The container image and the compose demo, checked without a Docker engine (none in CI): the
Dockerfile's stages use the install and build scripts CI uses, the runtime stage installs exactly
the `runtime` package set and that set is what `ldd build/keyguard` needs, paths and ports agree
with the build script and the image's config, the HEALTHCHECK command works against a real
keyguard, and compose's mounts, builds and scrape target exist and agree."""
import json
import os
import re
import shlex
import subprocess
import tempfile

import pytest
import yaml

from stack import KEYGUARD, ROOT, Keyguard, Redis, free_port

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


def test_compose_demo_is_wired():
    compose = yaml.safe_load(open(COMPOSE))
    services = compose["services"]
    assert set(services) == {"redis", "keyguard", "workload", "keyguard-tenants", "workload-tenants", "prometheus",
                             "grafana"}
    base = os.path.dirname(COMPOSE)
    kg = services["keyguard"]
    assert kg["build"]["dockerfile"] == "docker/Dockerfile"
    assert os.path.isfile(os.path.join(base, kg["build"]["context"], kg["build"]["dockerfile"]))
    assert os.path.isfile(os.path.join(base, services["workload"]["build"]["context"], "Dockerfile"))
    for svc in services.values():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            assert os.path.exists(os.path.join(base, src)), src
    # Each keyguard's command: the demo config it mounts (with every file that config names mounted
    # too), the redis service as upstream.
    admin_ports = {}
    for name in ("keyguard", "keyguard-tenants"):
        args = services[name]["command"]
        mounts = {v.split(":")[1]: os.path.join(base, v.split(":")[0]) for v in services[name]["volumes"]}
        demo_cfg = mounts[args[args.index("--config") + 1]]
        text = open(demo_cfg).read()
        for in_container, on_host in mounts.items():
            text = text.replace(in_container, on_host)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(text)
            f.flush()
            r = subprocess.run([KEYGUARD, "check-config", f.name], capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stdout + r.stderr)
        assert args[args.index("--upstream") + 1] == "redis:6379"
        admin_ports[name] = yaml.safe_load(open(demo_cfg))["admin"].rsplit(":", 1)[1]
    assert services["keyguard-tenants"]["image"] == kg["image"]
    # Redis has the ACL user keyguard-tenants authenticates as, with the password it reads.
    tenants_cfg = yaml.safe_load(open(os.path.join(base, "demo", "tenants.yaml")))
    password = open(os.path.join(base, "demo", "upstream-password")).read().strip()
    # (redis-server takes a directive's arguments as separate words: one "keyguard on ..." word
    # would be a user name with spaces.)
    acl = ["--user", tenants_cfg["upstream_auth"]["user"], "on", ">" + password, "~*", "&*", "+@all"]
    cmd = services["redis"]["command"]
    assert cmd[cmd.index("--user"):cmd.index("--user") + len(acl)] == acl
    # Prometheus scrapes both keyguards' admin ports and loads the chart's rule file.
    prom_cfg = yaml.safe_load(open(os.path.join(base, "prometheus", "prometheus.yml")))
    (job,) = prom_cfg["scrape_configs"]
    assert [c["targets"] for c in job["static_configs"]] == [["%s:%s" % (n, p)] for n, p in admin_ports.items()]
    assert len({c["labels"]["pod"] for c in job["static_configs"]}) == 2
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
    # The workload container runs the same script the e2e test runs, against keyguard.
    wl = services["workload"]["command"]
    assert wl[wl.index("--host") + 1] == "keyguard"
    wl = services["workload-tenants"]["command"]
    assert wl[wl.index("--host") + 1] == "keyguard-tenants" and "alice:alice-secret" in wl[wl.index("--tenants") + 1]
    assert "COPY workload.py" in open(os.path.join(base, "demo", "Dockerfile")).read()
