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


# ---------------------------------------------------------------- the parts of client/ and server/
BASE_MODULES = {"client": {"config", "event_loop"}, "server": {"config", "errors", "metrics"}}  # usable by every part


def _part_of(side: str, path: Path) -> str:
    """The part (sub-package, or top-level module without .py) of `side` that `path` belongs to."""
    parts = path.relative_to(PACKAGE / side).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _parts_imported(side: str, path: Path) -> set[str]:
    """The parts of `side` (corolla.client / corolla.server) that the module at `path` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in modules:
            names = module.split(".")
            if names[:2] == ["corolla", side] and len(names) > 2:
                found.add(names[2])
    return found


def _allowed(side: str, package: str) -> set[str]:
    """What `side`.`package` says it may import: its __init__ docstring's "May import:" line."""
    doc = ast.get_docstring(ast.parse((PACKAGE / side / package / "__init__.py").read_text())) or ""
    lines = [line for line in doc.splitlines() if line.startswith("May import:")]
    assert len(lines) == 1, f"corolla.{side}.{package}'s docstring must say once what it may import ('May import: ...')"
    named = lines[0].removeprefix("May import:").split("(")[0].strip().rstrip(".")
    return set() if named.startswith("nothing") else {name.strip() for name in named.split(",")}


def _packages(side: str) -> list[str]:
    return sorted(p.name for p in (PACKAGE / side).iterdir() if (p / "__init__.py").exists())


@pytest.mark.parametrize("side", ["client", "server"])
def test_every_part_imports_only_what_its_docstring_allows(side):
    offending = []
    for package in _packages(side):
        allowed = _allowed(side, package) | BASE_MODULES[side] | {package}
        for path in sorted((PACKAGE / side / package).rglob("*.py")):
            for part in sorted(_parts_imported(side, path) - allowed):
                offending.append(f"{path.relative_to(PACKAGE)} imports corolla.{side}.{part}")
    assert offending == []


@pytest.mark.parametrize("side", ["client", "server"])
def test_base_modules_import_no_part(side):
    offending = [
        f"{side}/{name}.py imports corolla.{side}.{part}"
        for name in sorted(BASE_MODULES[side])
        for part in sorted(_parts_imported(side, PACKAGE / side / f"{name}.py") - {name})
    ]
    assert offending == []


@pytest.mark.parametrize("side", ["client", "server"])
def test_the_parts_form_no_cycle(side):
    """A part's allowed imports only go down: following them never comes back to it."""
    packages = _packages(side)
    allowed = {p: _allowed(side, p) & set(packages) for p in packages}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in allowed[start])

    assert [p for p in packages if reaches(p, p, set())] == []


@pytest.mark.parametrize("side", ["client", "server"])
def test_no_module_of_client_or_server_is_over_400_lines(side):
    """Small modules, as STYLE.md asks: a module past 400 lines is doing two things; split it along them."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in (PACKAGE / side).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert long == {}
