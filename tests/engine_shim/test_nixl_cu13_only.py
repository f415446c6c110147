"""The shim extra installs NIXL's CUDA 13 build (`nixl-cu13`) alone, without the `nixl`
meta package that would pull the CUDA 12 build too: the shim's agent must start from it
(here on a CPU-only host, where it runs UCX on host memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")

SCRIPT = textwrap.dedent("""
    import sys
    class NoMetaPackage:
        def find_spec(self, name, path=None, target=None):
            if name == "nixl" or name.startswith("nixl."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, NoMetaPackage())
    from pdgate.engine_shim.nixl_agent import NixlAgent
    agent = NixlAgent("cu13-only-test")
    print("agent from", type(agent._agent).__module__)
""")


def test_the_agent_starts_from_nixl_cu13_alone() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "agent from nixl_cu13._api" in out.stdout
