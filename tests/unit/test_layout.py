"""Client and server share `protocol` and never import each other; importing corolla has no side effects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "corolla"


def imported_modules(package: str) -> set[str]:
    names: set[str] = set()
    for path in (PACKAGE / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


@pytest.mark.parametrize("package, forbidden", [("client", "corolla.server"), ("server", "corolla.client"), ("protocol", "corolla.client"), ("protocol", "corolla.server")])
def test_package_does_not_import_its_counterpart(package, forbidden):
    offending = sorted(m for m in imported_modules(package) if m == forbidden or m.startswith(forbidden + "."))
    assert offending == []


def test_importing_corolla_installs_no_log_handlers_and_loads_no_torch():
    code = "import logging, sys, corolla; print(len(logging.getLogger().handlers), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "False"]
