"""promtool, found on PATH or where `make pytest` extracts it, run on a scrape's text."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.e2e.cluster import ROOT

# Where the Makefile's `promtool` target puts it (from Debian's prometheus package).
LOCAL_PROMTOOL = ROOT / ".cache" / "promtool" / "promtool"


def promtool() -> str:
    """Path of promtool, or skip the calling test saying why it is missing."""
    found = shutil.which("promtool")
    if found is None and LOCAL_PROMTOOL.exists():
        found = str(LOCAL_PROMTOOL)
    if found is None:
        pytest.skip("promtool is not installed: `make pytest` extracts it from Debian's "
                    "prometheus package only when run as root (needs apt-get)")
    return found


def check_metrics(exposition: str) -> str:
    """What `promtool check metrics` finds wrong in `exposition` ('' when it is clean)."""
    out = subprocess.run([promtool(), "check", "metrics"], input=exposition, text=True,
                         capture_output=True, timeout=60)
    said = (out.stdout + out.stderr).strip()
    return "" if out.returncode == 0 and not said else f"exit {out.returncode}: {said}"
