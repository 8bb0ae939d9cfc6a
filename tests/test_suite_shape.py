"""The test suite's own shape: a test module imports helpers (tests/*_helpers.py, rpcclient,
served, modelgen) and fixtures come from conftest.py, never from another test module, so any test
file runs alone, in any order, or beside others in parallel."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another():
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found += [f"{path.relative_to(TESTS)}:{node.lineno} imports {n}" for n in names if n.startswith("test_")]
    assert found == []
