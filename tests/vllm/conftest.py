"""Session fixtures for the real-vLLM suite: the vLLM venv, the model, the engines, a router.

Everything heavy is started once per session: a prefill engine P (core 0), a decode engine
D (core 1), a reference engine REF (core 0) and pdgate's router in front of P and D (pull
mode). REF runs the same NixlConnector as P, so it also serves as the second prefill engine
of the 2P1D tests; a request without `kv_transfer_params` is an ordinary colocated one.
P and REF publish KV cache events. Every process is stopped at the end, also when
start-up fails half way.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vllm.model import ensure_vllm_tiny_model
from tests.vllm.processes import ROOT, Proc, start_router, start_vllm, wait_ready
from tests.vllm.venv import ensure_vllm_venv

LOG_DIR = ROOT / ".cache" / "vllm-logs"  # git-ignored; one process per file
ENGINE_START_TIMEOUT_S = 420.0  # three engines starting together on 2 shared cores


@dataclass
class VllmCluster:
    """The running processes of the session (URLs are base URLs without /v1)."""

    python: Path
    model_dir: Path
    log_dir: Path
    p: Proc
    d: Proc
    ref: Proc
    router: Proc
    stack: contextlib.ExitStack

    def start_router(self, name: str, prefill: list[str], decode: list[str],
                     extra_args: list[str] | None = None) -> Proc:
        """Another router (own log), stopped with the session; waits until it is ready."""
        proc = start_router(self.model_dir, prefill, decode, self.log_dir / name,
                            extra_args)
        self.stack.callback(proc.stop)
        wait_ready([proc], "/ready", 60.0)
        return proc

    def kv_events(self, proc: Proc) -> str:
        """The router's `--kv-events` value for engine `proc`."""
        assert proc.kv_events is not None
        return f"{proc.url}={proc.kv_events}"

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in (self.p, self.d, self.ref, self.router))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The push module first, then the modules that set `OWN_ENGINES` (test_vllm_chart.py):
    each starts its own engines (module scope) and stops them at its end, before the
    session's pull engines exist (both sets at once on a 2-core machine stall each other
    past the tests' deadlines)."""
    def group(item: pytest.Item) -> int:
        if item.get_closest_marker("vllm_push") is not None:
            return 0
        return 1 if getattr(getattr(item, "module", None), "OWN_ENGINES", False) else 2

    items.sort(key=group)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter of the cached vLLM venv (built on first use, ~1.5 min)."""
    return ensure_vllm_venv()


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_vllm_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-vllm")


@pytest.fixture(scope="session")
def vllm_log_dir() -> Path:
    """LOG_DIR, emptied once per session before any engine starts: a fixed place (not
    pytest's rotating tmp dirs) so every module's logs outlive the run (CI keeps them, and
    a failure can be read after the fact)."""
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    LOG_DIR.mkdir(parents=True)
    return LOG_DIR


@pytest.fixture(scope="session")
def vllm_cluster(vllm_python: Path, vllm_model_dir: Path,
                 vllm_log_dir: Path) -> Iterator[VllmCluster]:
    log_dir = vllm_log_dir
    with contextlib.ExitStack() as stack:
        def track(proc: Proc) -> Proc:
            stack.callback(proc.stop)
            return proc

        # ipc socket paths must be short (~100 bytes): a fresh dir in the system tmp.
        events = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdgate-kv-")))
        p = track(start_vllm(vllm_python, vllm_model_dir, "P", log_dir, core="0",
                             kv_events_dir=events))
        d = track(start_vllm(vllm_python, vllm_model_dir, "D", log_dir, core="1"))
        ref = track(start_vllm(vllm_python, vllm_model_dir, "REF", log_dir, core="0",
                               kv_events_dir=events))
        wait_ready([p, d, ref], "/health", ENGINE_START_TIMEOUT_S)
        router = track(start_router(vllm_model_dir, [p.url], [d.url], log_dir))
        wait_ready([router], "/ready", 60.0)
        yield VllmCluster(vllm_python, vllm_model_dir, log_dir, p, d, ref, router, stack)
