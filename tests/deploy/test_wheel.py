"""The wheel users install: one `pdgate` import namespace, honest metadata, and a router that
runs from a fresh virtual environment without the `shim` extra (no torch, no nixl).

Builds the wheel from this checkout and installs it into a new venv (its dependencies come
from the package index, or pip's cache after `make test` built .venv)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The checkout's setuptools (>= 77, SPDX license expressions) builds it: no download.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=300)
    (path,) = out.glob("pdgate-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=600)
    return env


def test_everything_installs_under_the_pdgate_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"pdgate", wheel.name.split("-py3")[0] + ".dist-info"}
    for package in ("router", "proxy", "engine_shim"):
        assert f"pdgate/{package}/__init__.py" in names
    assert "pdgate/py.typed" in names


def test_metadata_has_spdx_license_classifiers_and_urls(wheel: Path) -> None:
    (meta_name,) = [n for n in zipfile.ZipFile(wheel).namelist()
                    if n.endswith(".dist-info/METADATA")]
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(meta_name).decode())
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.11"
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # SPDX replaces them
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source"} <= set(urls)
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"shim", "otel"} <= extras
    core = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert not [r for r in core if r.startswith(("torch", "nixl"))]


def run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "pdgate"), *args], capture_output=True,
                          text=True, timeout=120, cwd=venv)


def test_router_help_and_version_work_without_the_shim_extra(venv: Path) -> None:
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.util as u; print([m for m in ('torch', 'nixl', 'router', 'proxy',"
         " 'engine_shim') if u.find_spec(m)])"],
        capture_output=True, text=True, timeout=60, cwd=venv, check=True)
    assert probe.stdout.strip() == "[]"  # no torch/nixl, and no bare top-level names
    helped = run(venv, "router", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--prefill" in helped.stdout and "--pd-mode" in helped.stdout
    version = run(venv, "--version")
    assert version.returncode == 0 and version.stdout.strip() == "pdgate 0.1.0"


@pytest.mark.parametrize("command", ["shim", "up"])
def test_engine_commands_name_the_missing_extra(venv: Path, command: str) -> None:
    out = run(venv, command, "--help")
    assert out.returncode == 2
    assert "pip install 'pdgate[shim]'" in out.stderr and "torch" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_router_image_context_builds_a_wheel_without_the_shim(tmp_path: Path) -> None:
    """What the Dockerfile's router stage copies (no engine_shim/): the `pdgate/engine_shim`
    link dangles there and the wheel has the router and proxy only."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("router", "proxy", "pdgate"):
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("pdgate-*.whl")
    packages = {n.rsplit("/", 1)[0] for n in zipfile.ZipFile(wheel).namelist()
                if n.endswith("/__init__.py")}
    assert {"pdgate", "pdgate/router", "pdgate/proxy"} <= packages
    assert not [p for p in packages if "engine_shim" in p]
