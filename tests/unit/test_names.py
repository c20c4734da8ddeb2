"""One word, one meaning (issue 40): no two classes of the package share a name, so a name in a
log, a traceback or a docstring says which class it is without its module."""

from __future__ import annotations

import ast
from collections import defaultdict

from tests.helpers import ROOT

PACKAGE = ROOT / "src" / "remote_loader"


def test_no_two_classes_of_the_package_share_a_name() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name.endswith("_pb2.py"):
            continue  # generated: the wire's message names (protos/loader.proto)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, f"class names used more than once: {shared}"
