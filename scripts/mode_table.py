#!/usr/bin/env python3
"""The table of the integration tests whose results must differ by upstream mode, with the reason
each gives: every test marked `dedicated_only(reason=...)` (skipped with shared upstream
connections and in the cluster pass) or `not_cluster(reason=...)` (skipped in the cluster pass).
Read from the test files' source (ast), so the table in docs/modes.md is the markers themselves.
usage: scripts/mode_table.py [--write]   (--write: replace the table in docs/modes.md)"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "integration")
DOC = os.path.join(ROOT, "docs", "modes.md")
BEGIN, END = "<!-- mode table: scripts/mode_table.py --write -->", "<!-- end of mode table -->"
MODES = {"dedicated_only": "shared, cluster", "not_cluster": "cluster"}


def text(value, consts):
    """A reason as written: a string (or a sum of them), or a module-level constant naming one."""
    try:
        return ast.literal_eval(value)
    except ValueError:
        pass
    if isinstance(value, ast.Name) and value.id in consts:
        return consts[value.id]
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        return text(value.left, consts) + text(value.right, consts)
    return ast.unparse(value)


def marks(node, consts):
    for d in getattr(node, "decorator_list", []):
        if not isinstance(d, ast.Call) or not isinstance(d.func, ast.Attribute):
            continue
        name = d.func.attr
        if name in MODES and isinstance(d.func.value, ast.Attribute) and d.func.value.attr == "mark":
            reason = next((text(k.value, consts) for k in d.keywords if k.arg == "reason"), "")
            yield name, reason


def rows():
    out = []
    for f in sorted(os.listdir(TESTS)):
        if not (f.startswith("test_") and f.endswith(".py")):
            continue
        tree = ast.parse(open(os.path.join(TESTS, f)).read())
        consts = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    consts[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                for name, reason in marks(node, consts):
                    out.append((f, node.name, MODES[name], reason))
    return out


def table():
    lines = ["| test | differs with | reason |", "|---|---|---|"]
    for f, test, modes, reason in rows():
        lines.append("| `%s::%s` | %s | %s |" % (f, test, modes, reason.replace("|", "\\|")))
    return "\n".join(lines)


def main():
    text = open(DOC).read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + BEGIN + "\n" + table() + "\n" + END + tail
    if "--write" in sys.argv:
        open(DOC, "w").write(new)
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
