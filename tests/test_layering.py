"""The packages' import directions, read from every module's imports with `ast`.

Between packages: router → proxy ← engine_shim, with `contract` (pure data) and `common`
(shared plumbing) below all three; `proxy` imports neither router nor shim, the shim never
imports the router, and nothing but the router itself, the `pdgate` CLI, tests and
benchmarks imports `router` (so the shim image needs no router code). No module anywhere
imports a bare top-level `router`, `proxy` or `engine_shim`: one physical path per module.

Inside the router: HTTP on top, flows and policies in the middle, the engine client at the
bottom: `flows/`, `policies/` and `engines/` never import `http/`; `engines/` never imports
`flows/`, `policies/` or the pool."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pdgate"
PACKAGES = ("router", "proxy", "engine_shim", "contract", "common")
FORBIDDEN = {
    "contract": {"router", "proxy", "engine_shim", "common", "pdgate"},
    "common": {"router", "proxy", "engine_shim", "pdgate"},
    "proxy": {"router", "engine_shim", "pdgate"},
    "engine_shim": {"router"},
    "router": {"engine_shim"},
}
# Inside the router: sub-package -> the router modules/sub-packages it must not import.
ROUTER_FORBIDDEN = {
    "flows": {"http"},
    "policies": {"http"},
    "engines": {"http", "flows", "policies", "pool", "orchestrator"},
    "input": {"http", "flows"},
}
BARE = {"router", "proxy", "engine_shim"}


def package_of(module: str) -> str:
    """`pdgate.router.app` -> `router`; `pdgate.cli` -> `pdgate`; `os.path` -> `os`."""
    parts = module.split(".")
    if parts[0] == "pdgate" and len(parts) > 1 and parts[1] in FORBIDDEN:
        return parts[1]
    return parts[0]


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports (`from a import b` counts `a` and `a.b`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def imported_packages(path: Path) -> set[str]:
    return {package_of(m) for m in imported_modules(path)}


def python_sources() -> list[Path]:
    return [p for top in ("src", "tests", "bench") for p in sorted((ROOT / top).rglob("*.py"))]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_allowed_directions(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((SRC / package).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_router_is_imported_only_by_its_cli_tests_and_benchmarks() -> None:
    users = {
        str(path.relative_to(ROOT))
        for top in SRC.iterdir() if top.is_dir() and top.name != "router"
        for path in top.rglob("*.py") if "router" in imported_packages(path)
    }
    assert users == set()


def test_no_module_imports_a_bare_top_level_package() -> None:
    offenders = {str(p.relative_to(ROOT)): sorted({m.split(".")[0] for m in imported_modules(p)}
                                                   & BARE)
                 for p in python_sources()}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert not [p for p in (ROOT / name for name in BARE) if p.exists()]
    assert not [p for p in SRC.rglob("*") if p.is_symlink()]


def router_part(module: str) -> str | None:
    """`pdgate.router.http.app` -> `http`; `pdgate.router.pool` -> `pool`; else None."""
    parts = module.split(".")
    if parts[:2] == ["pdgate", "router"] and len(parts) > 2:
        return parts[2]
    return None


@pytest.mark.parametrize("sub", sorted(ROUTER_FORBIDDEN))
def test_router_layers_import_only_downwards(sub: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            {router_part(m) for m in imported_modules(path)} & ROUTER_FORBIDDEN[sub])
        for path in sorted((SRC / "router" / sub).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import os\nfrom pdgate.router.http.app import create_app\n"
                   "import pdgate.engine_shim.cli\nfrom pdgate.cli import main\n"
                   "from pdgate.router import pool\nimport router.api\n")
    assert imported_packages(bad) == {"os", "router", "engine_shim", "pdgate"}
    assert {router_part(m) for m in imported_modules(bad)} >= {"http", "pool"}
    assert "router.api" in imported_modules(bad)
