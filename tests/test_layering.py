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


# Only router/engines/ (and contract/) parse engine replies: the router modules on the
# request path that get engine answers (flows, orchestrator, aborts, pool, health) hold
# them decoded and typed, so they call no JSON decoder and read no reply field by name.
ENGINE_FACING = ("flows", "orchestrator.py", "aborts.py", "pool.py", "health.py")
# flows/push_identity.py reads a vLLM push answer's identity keys (to move into engines/
# with that module's next rework); none of the names below.
DECODERS = {"msgspec.json.decode", "msgspec.json.Decoder", "msgspec.convert",
            "msgspec.msgpack.decode", "json.loads", "json.load"}
REPLY_FIELDS = {"choices", "usage", "kv_transfer_params", "prompt_token_ids", "token_ids",
                "finish_reason", "engine_id", "block_ids", "reservation_id",
                "first_token_ids", "landed_tokens", "pdgate_mode", "remote_num_tokens",
                "completion_tokens", "message", "text"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def reply_parsing(path: Path) -> list[str]:
    """Where `path` decodes JSON or reads an engine reply field by name (line: what)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = None
        if isinstance(node, ast.Attribute) and _dotted(node) in DECODERS:
            what = _dotted(node)
        elif isinstance(node, ast.ImportFrom) and node.module in ("msgspec.json", "json"):
            what = f"from {node.module} import"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in REPLY_FIELDS:
            what = f".get({node.args[0].value!r})"
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and isinstance(node.slice, ast.Constant) and node.slice.value in REPLY_FIELDS:
            what = f"[{node.slice.value!r}]"
        if what is not None:
            found.append(f"{getattr(node, 'lineno', 0)}: {what}")
    return found


def test_only_the_engine_client_parses_engine_replies() -> None:
    paths = [p for name in ENGINE_FACING for p in sorted((SRC / "router").glob(name))]
    paths = [q for p in paths for q in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    assert len(paths) > 10
    offenders = {str(p.relative_to(ROOT)): reply_parsing(p) for p in paths}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_reply_parsing(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import msgspec\nreply = msgspec.json.decode(raw)\n"
                   "ids = reply['choices'][0].get('token_ids')\nbody['choices'] = []\n")
    assert sorted(reply_parsing(bad)) == ["2: msgspec.json.decode", "3: .get('token_ids')",
                                          "3: ['choices']"]
