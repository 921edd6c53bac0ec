"""docs/modes.md's table of the tests whose results differ by mode is the tests' own markers
(scripts/mode_table.py reads them): this fails when a marker is added, removed or reworded and the
table was not written again (`python3 scripts/mode_table.py --write`)."""
import os
import subprocess
import sys

from conftest import ROOT


def test_the_mode_table_in_the_docs_is_the_markers():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mode_table.py")], capture_output=True,
                         text=True, check=True).stdout
    doc = open(os.path.join(ROOT, "docs", "modes.md")).read()
    assert out.strip() in doc, "docs/modes.md is not current: run python3 scripts/mode_table.py --write"
    assert out.count("\n| `") >= 40  # (the markers are found: 45 when this was written)
