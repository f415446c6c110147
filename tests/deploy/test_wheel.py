"""The wheel users install: one `pdgate` import namespace, honest metadata, and a router that
runs from a fresh virtual environment without the `shim` extra (no torch, no nixl).

Builds the wheel from this checkout and installs it into a new venv (its dependencies come
from the package index, or pip's cache after `make test` built .venv)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.deploy.test_dockerfile import parse_dockerfile

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


def stage_context(stage_name: str, dest: Path) -> None:
    """Copy what the Dockerfile's `stage_name` stage COPYs from the build context (not from
    other stages, not heredocs) into `dest`, at the destinations it names under /src."""
    text = (ROOT / "Dockerfile").read_text()
    _, stages = parse_dockerfile(text)
    (stage,) = [s for s in stages if s.name == stage_name]
    for instr in stage.all("COPY"):
        words = shlex.split(instr.args)
        if instr.heredoc is not None or any(w.startswith("--from=") for w in words):
            continue
        *sources, target = words
        for source in sources:
            src = ROOT / source
            to = dest / target / src.name if target.endswith("/") else dest / target
            to.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, to, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, to)


# stage -> (the entry point its image runs, the package it must not hold)
STAGES = {"router-build": ("pdgate.router.cli", "pdgate.engine_shim"),
          "shim": ("pdgate.engine_shim.cli", "pdgate.router")}


@pytest.mark.parametrize("stage_name", sorted(STAGES))
def test_each_image_stage_builds_and_imports_from_its_own_files(
    stage_name: str, tmp_path: Path,
) -> None:
    """Each stage's file list, built into a wheel and installed into a fresh target, imports
    its entry point, and holds no package of the other image."""
    src = tmp_path / "src"
    stage_context(stage_name, src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("pdgate-*.whl")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(target), str(wheel)], check=True, timeout=300)
    entry, foreign = STAGES[stage_name]
    # The target comes first on the path, so its `pdgate` wins over this checkout's.
    probe = subprocess.run(
        [sys.executable, "-c",
         "import importlib, importlib.util as u, pdgate;"
         f"importlib.import_module({entry!r}); print(pdgate.__file__);"
         f"print(u.find_spec({foreign!r}))"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr
    where, spec = probe.stdout.split()
    assert where.startswith(str(target)) and spec == "None"
