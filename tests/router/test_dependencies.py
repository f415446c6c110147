"""The router's dependency set: transformers only in the `hf` extra (the router names it
when a feature needs it and it is missing), no aiohttp in the core, httpx declared,
uvicorn bounded where router/http/client_deadlines.py uses its internals, and every
third-party module src/pdgate imports declared."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {Requirement(s).name: Requirement(s) for s in PROJECT["dependencies"]}
EXTRAS = PROJECT["optional-dependencies"]

# Runs in a fresh interpreter with transformers made unimportable, as in a core install.
NO_TRANSFORMERS = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("transformers", "tokenizers"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Block())
    from pdgate.router.cli import main
    from pdgate.router.http.app import create_app
    from pdgate.router.cli import config_from_args
    args = ["--model", "m", "--prefill", "http://127.0.0.1:1", "--decode",
            "http://127.0.0.1:2", *sys.argv[1:]]
    if not sys.argv[1:]:
        create_app(config_from_args(args))
        assert "transformers" not in sys.modules
        print("served without transformers")
    else:
        sys.exit(main(args))
""")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_TRANSFORMERS, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_default_router_needs_no_transformers() -> None:
    out = run()
    assert out.returncode == 0, out.stderr
    assert "served without transformers" in out.stdout


@pytest.mark.parametrize("flags", [["--tokenize-prompts", "always"],
                                   ["--decode-policy", "prefix-aware"],
                                   ["--pd-mode", "notify"]])
def test_a_feature_needing_a_tokenizer_names_the_hf_extra(flags: list[str]) -> None:
    out = run(*flags)
    assert out.returncode == 2
    assert "install the hf extra (pip install 'pdgate[hf]')" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_transformers_and_aiohttp_are_not_core_and_dev_installs_what_tests_need() -> None:
    assert not {"transformers", "tokenizers", "aiohttp", "fastapi"} & set(CORE)
    assert {Requirement(s).name for s in EXTRAS["hf"]} == {"transformers", "tokenizers"}
    assert "pdgate[hf]" in EXTRAS["shim"]
    dev = [Requirement(s) for s in EXTRAS["dev"]]
    assert any(r.name == "pdgate" and {"hf", "otel"} <= r.extras for r in dev)
    assert any(r.name == "aiohttp" for r in dev)  # the tests' fake engines
    assert "httpx" in CORE  # discovery's client
    shim = {Requirement(s).name: Requirement(s) for s in EXTRAS["shim"]}
    assert "nixl" not in shim and "nixl-cu13" in shim
    assert shim["torch"].specifier.contains("2.13.0")  # what vLLM 0.32 pins


def test_uvicorn_is_bounded_and_the_installed_one_is_inside() -> None:
    """router/http/client_deadlines.py subclasses uvicorn's HttpToolsProtocol and reads
    its request cycle: a uvicorn release outside the tested range must fail here, loudly,
    before it fails in production. Test the new release, then move the bound."""
    spec = CORE["uvicorn"].specifier
    assert any(s.operator in ("<", "<=") for s in spec), "uvicorn needs an upper bound"
    installed = Version(version("uvicorn"))
    assert spec.contains(installed), (
        f"uvicorn {installed} is outside the tested range {spec}: check "
        "router/http/client_deadlines.py against its HttpToolsProtocol, then move the bound")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    for name in ("connection_made", "data_received", "on_message_begin",
                 "on_headers_complete", "on_message_complete", "connection_lost"):
        assert callable(getattr(HttpToolsProtocol, name, None)), name
    assert "scope" in RequestResponseCycle.__init__.__code__.co_varnames


# Imported but deliberately not declared, with the reason.
UNDECLARED_OK = {
    # engine_shim/nixl_agent.py tries the `nixl` meta package's module first and falls back
    # to nixl-cu13's, which the shim extra installs (tests/engine_shim/test_nixl_cu13_only.py).
    "nixl": "nixl-cu13 fallback",
}
# The packages whose modules a core install must be able to import without the shim extra.
CORE_PACKAGES = ("router", "proxy", "contract", "common")


def _imports(package: str) -> set[str]:
    """Top-level names of the third-party modules imported anywhere in src/pdgate/<package>."""
    names: set[str] = set()
    for path in (ROOT / "src" / "pdgate" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "pdgate"}


def _declared(*groups: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(s).name) for group in groups for s in group}


@pytest.mark.parametrize("package", [*CORE_PACKAGES, "engine_shim"])
def test_every_imported_package_is_declared(package: str) -> None:
    """Each third-party module src/pdgate imports comes from a declared distribution: the
    core, or an extra (the router's only lazily: hf, otel; the shim's also from `shim`)."""
    extras = ["hf", "otel"] + ([] if package in CORE_PACKAGES else ["shim"])
    declared = _declared(PROJECT["dependencies"], *(EXTRAS[e] for e in extras))
    dists = packages_distributions()
    for name in sorted(_imports(package) - UNDECLARED_OK.keys()):
        provided_by = {canonicalize_name(d) for d in dists.get(name, [name])}
        assert provided_by & declared, f"{package} imports {name} ({provided_by}): undeclared"
