"""The packages' import directions: router → proxy ← engine_shim. `proxy` imports neither,
the shim never imports the router, and nothing but the router itself, the `pdgate` CLI,
tests and benchmarks imports `router` (so the shim image needs no router code)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "proxy": {"router", "engine_shim", "pdgate"},
    "engine_shim": {"router"},
    "router": {"engine_shim"},
}


def package_of(module: str) -> str:
    """`pdgate.router.app` -> `router`; `pdgate.cli` -> `pdgate`; `os.path` -> `os`."""
    parts = module.split(".")
    if parts[0] == "pdgate" and len(parts) > 1 and parts[1] in FORBIDDEN:
        return parts[1]
    return parts[0]


def imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(package_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(package_of(node.module))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_allowed_directions(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_router_is_imported_only_by_its_cli_tests_and_benchmarks() -> None:
    allowed = {"router", "pdgate", "tests", "bench"}
    users = {
        str(path.relative_to(ROOT))
        for top in ROOT.iterdir() if top.is_dir() and top.name not in allowed
        and not top.name.startswith(".") and (top / "__init__.py").exists()
        for path in top.rglob("*.py") if "router" in imported_packages(path)
    }
    assert users == set()


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import os\nfrom pdgate.router.app import create_app\n"
                   "import pdgate.engine_shim.cli\nfrom pdgate.cli import main\n")
    assert imported_packages(bad) == {"os", "router", "engine_shim", "pdgate"}
