"""The CLI reference (docs/cli.md) is generated from the parsers; a stale page fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdgate import cli_docs

ROOT = Path(__file__).resolve().parent.parent


def test_readme_cli_reference_matches_help() -> None:
    readme = (ROOT / "docs" / "cli.md").read_text()
    assert cli_docs.replace_section(readme, cli_docs.render()) == readme, (
        "docs/cli.md is stale: run `python -m pdgate.cli_docs --write docs/cli.md`"
    )


def test_every_subcommand_has_help() -> None:
    for sub in ("router", "shim", "up"):
        out = subprocess.run(
            [sys.executable, "-m", "pdgate.cli", sub, "--help"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        assert "usage:" in out.stdout


def test_unknown_subcommand_is_rejected() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdgate.cli", "frobnicate"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 2
    assert "unknown subcommand" in out.stderr
