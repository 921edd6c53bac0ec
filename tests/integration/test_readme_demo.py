"""The README's 60-second demo stays true: each `$ ` command of its two blocks is run (redis-cli and
curl against a keyguard with the same example config, on free ports) and must print exactly the
lines the README shows."""
import os
import re
import subprocess

import pytest

from conftest import ROOT, Keyguard, Redis

README = open(os.path.join(ROOT, "README.md")).read()


def demo_blocks():
    """[(config file, [(command, expected output lines)])] from the README's demo section."""
    section = README.split("## In 60 seconds", 1)[1].split("\n## ", 1)[0]
    configs = re.findall(r"bash scripts/run\.sh --config (\S+?)`", section)
    blocks = []
    for block in re.findall(r"((?:\n    .*)+)", section):
        steps = []
        for line in block.strip("\n").split("\n"):
            line = line[4:]
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
        blocks.append(steps)
    assert len(configs) == len(blocks) == 2, (configs, len(blocks))
    return list(zip(configs, blocks))


@pytest.mark.parametrize("config,steps", demo_blocks(), ids=["strict", "rewrite-legacy"])
def test_readme_demo(config, steps):
    r = Redis()
    kg = Keyguard(r.port, config=open(os.path.join(ROOT, config)).read())
    try:
        for command, expected in steps:
            command = command.replace("-p 6380", "-p %d" % kg.port).replace("localhost:9121", "127.0.0.1:%d" % kg.admin_port)
            p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
            # redis-cli prints errors as "(error) ..." on a terminal only; the README shows the terminal.
            got = [("(error) " + l if l.startswith(("ERR ", "WRONGTYPE ")) else l) for l in p.stdout.splitlines()]
            while got and got[-1] == "":  # redis-cli ends an error with an empty line when piped
                got.pop()
            assert got == expected, (command, p.stdout, p.stderr)
    finally:
        assert kg.stop() == 0, kg.output()
        r.stop()
