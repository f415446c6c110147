"""Render the Helm chart without helm: build tests/deploy/helmrender (Go text/template +
Debian's sprig, the engine Helm uses) once per session and run it.

Needs Debian's golang-go, golang-github-masterminds-sprig-dev and golang-k8s-sigs-yaml-dev
(`make test` installs them when run as root). Without them the tests skip locally and fail
under CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdgate"
GOCODE = Path("/usr/share/gocode/src")
DEBIAN_PACKAGES = "golang-go golang-github-masterminds-sprig-dev golang-k8s-sigs-yaml-dev"
# GOPATH mode does not resolve /vN import paths; a vendor dir of links maps them.
_VENDOR_LINKS = {
    "github.com/Masterminds/sprig/v3": "github.com/Masterminds/sprig",
    "github.com/Masterminds/semver/v3": "github.com/Masterminds/semver",
}


def unavailable(reason: str) -> None:
    """Skip on a developer machine; in CI a missing tool is a failure, not a skip."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def build(workdir: Path) -> Path:
    """Compile the renderer into `workdir`; returns the binary."""
    if shutil.which("go") is None or not (GOCODE / "github.com/Masterminds/sprig").is_dir():
        unavailable(f"Go + sprig not installed (apt-get install {DEBIAN_PACKAGES})")
    src = workdir / "gopath" / "src" / "helmrender"
    src.mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "helmrender" / "main.go", src / "main.go")
    for import_path, debian_dir in _VENDOR_LINKS.items():
        link = src / "vendor" / import_path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(GOCODE / debian_dir)
    binary = workdir / "helmrender"
    env = {**os.environ, "GO111MODULE": "off", "GOFLAGS": "",
           "GOPATH": f"{workdir / 'gopath'}:{GOCODE.parent}"}
    subprocess.run(["go", "build", "-o", str(binary), "."], cwd=src, env=env, check=True,
                   timeout=300)
    return binary


@dataclass
class Rendered:
    manifests: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [m for m in self.of(kind) if m["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
        return found[0]


class Renderer:
    """Runs the built renderer on the chart, like `helm template`."""

    def __init__(self, binary: Path) -> None:
        self.binary = binary

    def run(self, *values: Path, api_versions: tuple[str, ...] = (), notes: bool = False,
            release: str = "demo", namespace: str = "llm") -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), "-name", release, "-namespace", namespace]
        for v in values:
            argv += ["-f", str(v)]
        for a in api_versions:
            argv += ["-api-versions", a]
        if notes:
            argv.append("-notes")
        return subprocess.run([*argv, str(CHART)], capture_output=True, text=True, timeout=60)

    def render(self, *values: Path, api_versions: tuple[str, ...] = ()) -> Rendered:
        out = self.run(*values, api_versions=api_versions)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        return Rendered(docs)

    def error(self, *values: Path, api_versions: tuple[str, ...] = ()) -> str:
        out = self.run(*values, api_versions=api_versions)
        assert out.returncode != 0, "rendering should have failed"
        return out.stderr
