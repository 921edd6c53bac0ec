"""The Grafana dashboards as files: current schema, the datasource as a variable, namespace/pod/
tenant variables that match everything (series without the label too) on "All", and panels that
a person can read: a unit, a description that says what to do, legends, no overlapping tiles.
What the queries return is checked against a real Prometheus in test_observability.py."""
import json
import os

import pytest

from stack import DASHBOARDS

FILES = sorted(os.listdir(DASHBOARDS))


def load(name):
    with open(os.path.join(DASHBOARDS, name)) as f:
        return json.load(f)


def test_the_two_dashboards():
    assert FILES == ["keyguard-hygiene.json", "keyguard-proxy.json"]
    assert [load(f)["uid"] for f in FILES] == ["keyguard-hygiene", "keyguard-proxy"]


@pytest.mark.parametrize("name", FILES)
def test_schema_and_variables(name):
    d = load(name)
    assert 36 <= d["schemaVersion"] <= 41 and d["title"].startswith("keyguard / ")
    v = {x["name"]: x for x in d["templating"]["list"]}
    assert list(v) == ["datasource", "namespace", "pod", "tenant"]
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name in ("namespace", "pod", "tenant"):
        assert v[name]["type"] == "query" and v[name]["includeAll"] is True
        # ".*" also matches a series without the label: compose and bare-metal scrapes have no
        # namespace/pod, and no keyguard series has a tenant label yet.
        assert v[name]["allValue"] == ".*"
        assert v[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


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
            for var in ("$namespace", "$pod", "$tenant"):
                assert t["expr"].count("keyguard_") == t["expr"].count(var), (p["title"], var, t["expr"])
            if p["type"] == "timeseries":
                assert t["legendFormat"], p["title"]
