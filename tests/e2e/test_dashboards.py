"""The Grafana dashboards as files: current schema, the datasource as a variable, namespace/pod
(and on the Proxy dashboard tenant) variables that match everything (series without the label
too) on "All", a Tenants row whose panels alone filter by tenant, and panels that a person can read: a unit, a description that says what to do, legends, no overlapping tiles.
What the queries return is checked against a real Prometheus in test_observability.py."""
import json
import os
import re

import pytest

from stack import DASHBOARDS

FILES = sorted(os.listdir(DASHBOARDS))


def load(name):
    with open(os.path.join(DASHBOARDS, name)) as f:
        return json.load(f)


def test_the_two_dashboards():
    assert FILES == ["keyguard-hygiene.json", "keyguard-proxy.json"]
    assert [load(f)["uid"] for f in FILES] == ["keyguard-hygiene", "keyguard-proxy"]


# The variables of each dashboard: only the Proxy dashboard has per-tenant panels.
VARIABLES = {"keyguard-hygiene.json": ["datasource", "namespace", "pod"],
             "keyguard-proxy.json": ["datasource", "namespace", "pod", "tenant"]}


@pytest.mark.parametrize("name", FILES)
def test_schema_and_variables(name):
    d = load(name)
    assert 36 <= d["schemaVersion"] <= 41 and d["title"].startswith("keyguard / ")
    v = {x["name"]: x for x in d["templating"]["list"]}
    assert list(v) == VARIABLES[name]
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name in list(v)[1:]:
        assert v[name]["type"] == "query" and v[name]["includeAll"] is True
        # ".*" also matches a series without the label: compose and bare-metal scrapes have no
        # namespace/pod.
        assert v[name]["allValue"] == ".*"
        assert v[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    if "tenant" in v:
        # The tenants that the selected keyguards have seen.
        assert v["tenant"]["query"]["query"] == (
            'label_values(keyguard_tenant_commands_total{namespace=~"$namespace", pod=~"$pod"}, tenant)')


def test_tenants_row_on_the_proxy_dashboard():
    panels = load("keyguard-proxy.json")["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Tenants")
    tenant_panels = panels[row + 1:]
    used = {m for p in tenant_panels for t in p["targets"] for m in re.findall(r"keyguard_\w+", t["expr"])}
    assert used == {"keyguard_tenant_commands_total", "keyguard_tenant_received_bytes_total",
                    "keyguard_tenant_sent_bytes_total", "keyguard_tenant_rejected_total"}
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in tenant_panels}
    assert units["Commands by tenant"] == "ops" and units["Bytes by tenant"] == "Bps"
    for p in tenant_panels:
        for t in p["targets"]:
            assert "by (tenant" in t["expr"], t["expr"]
            if p["type"] == "timeseries":
                assert "{{tenant}}" in t["legendFormat"], t


@pytest.mark.parametrize("name", FILES)
def test_panels_are_readable(name):
    d = load(name)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    tiles = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & tiles, "%s overlaps another panel" % p["title"]
        tiles |= cells
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert len(p["description"]) > 40, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"] and t["refId"]
            for var in ("$namespace", "$pod"):
                assert t["expr"].count("keyguard_") == t["expr"].count(var), (p["title"], var, t["expr"])
            # Only keyguard_tenant_* series carry a tenant label: a tenant filter on any other would
            # empty the panel as soon as one tenant is picked.
            assert t["expr"].count("keyguard_tenant_") == t["expr"].count('tenant=~"$tenant"'), (p["title"], t["expr"])
            if p["type"] == "timeseries":
                assert t["legendFormat"], p["title"]
