"""Installed into the vLLM test venv (with a `.pth` line that imports it at interpreter start).

Settings vLLM and nixl offer no knob for, each active only when its variable is set
(tests/vllm/processes.py sets them for every engine; docs/vllm.md says what failed without
them on a 2-core machine):

`PDGATE_NIXL_PTHR_DELAY_US` (µs): nixl 1.5.1's Python `nixl_agent` hard-codes the progress
thread's delay to 0 µs, so every vLLM engine's NIXL agent spins a whole core even when idle;
two engines on a 2-core machine then slow decode about 10x. vLLM builds the agent through
`nixl._api.nixl_agent`; the hook wraps the pybind `nixlAgent` constructor the `_api` module
calls and sets `pthrDelay` on the config it is given.

`PDGATE_ENGINE_CORES` (a core list such as "0", "0,1" or vLLM's per-rank "0|1"): every
process of the engine runs only there, from interpreter start. `VLLM_CPU_OMP_THREADS_BIND`
pins only the workers; the API server and engine core floated onto the other engine's core.
And on CPU, vLLM's NIXL worker moves its main thread to the last core of each NUMA node,
"reserved" for KV transfer, and every thread it starts later follows (NIXL's progress
thread). On a 2-core machine that put every engine's main and NIXL threads on core 1, beside
the decode engine pinned there. The hook makes that call pin the thread to the engine's own
cores instead.

`PDGATE_VLLM_MQ_SPIN_S` (seconds) and `PDGATE_VLLM_MQ_RECHECK_MS`: vLLM's shared-memory
message queue readers (each worker waiting for its engine core's next step, the engine core
waiting for the workers' output) spin on `sched_yield` for 1 s after every message before
they block on the queue's ZMQ notification. An engine that steps at least once a second
therefore never leaves its core, and on this kernel a task spinning on `sched_yield` kept
others on the same core from running for minutes (a restarted engine's process, an engine
core's NIXL handshake listener). With the spin set to 0 a reader blocks at once; but the
notification can be lost (vLLM's own comment on `SHM_READER_RECHECK_INTERVAL_MS`: a blocked
reader looks at the queue again after 5 s to recover), and without the spin that happened
every few steps: a decode engine produced 0.3 tokens/s. So a blocked reader also looks
again every few milliseconds.

The patches are applied lazily, when the module concerned is first imported (interpreters
that never use it pay nothing). This file is copied, never imported, by the test package;
it depends on the stdlib only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

_DELAY_ENV = "PDGATE_NIXL_PTHR_DELAY_US"
_CORES_ENV = "PDGATE_ENGINE_CORES"
_SPIN_ENV = "PDGATE_VLLM_MQ_SPIN_S"
_RECHECK_ENV = "PDGATE_VLLM_MQ_RECHECK_MS"
_RESERVING_MODULE = ".nixl.base_worker"  # vLLM's module that reserves the KV-transfer core
_NIXL_API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")
_MQ_MODULE = "vllm.distributed.device_communicators.shm_broadcast"

Patch = Callable[[types.ModuleType], None]


class _DelayedBindings(types.ModuleType):
    """Stands in for `nixl_*._bindings` inside `_api`: everything is the real module's,
    except `nixlAgent`, which sets the progress-thread delay on its config first."""

    def __init__(self, real: types.ModuleType, delay_us: int) -> None:
        super().__init__(real.__name__)
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (nixl's spelling)
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _delay_patch(delay_us: int) -> Patch:
    def patch(module: types.ModuleType) -> None:
        real = getattr(module, "nixlBind", None)
        if isinstance(real, types.ModuleType):
            module.nixlBind = _DelayedBindings(real, delay_us)  # type: ignore[attr-defined]
    return patch


def _queue_patch(spin_s: float | None, recheck_ms: int | None) -> Patch:
    def patch(module: types.ModuleType) -> None:
        if spin_s is not None:  # vLLM never passes busy_loop_s: its default is the spin
            module.SpinCondition.__init__.__defaults__ = (spin_s,)
        if recheck_ms is not None:
            setattr(module, "SHM_READER_RECHECK_INTERVAL_MS", recheck_ms)  # noqa: B010
    return patch


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Patch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the modules in `patches` as usual, then applies their patch."""

    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)  # type: ignore[arg-type]
        return spec


def _pin_reserved_core(cores: set[int]) -> None:
    """`os.sched_setaffinity` as vLLM's NIXL worker calls it (the calling thread, from its
    module) pins to `cores`; every other call is unchanged."""
    real = os.sched_setaffinity

    def sched_setaffinity(pid: int, mask: Any) -> None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        real(pid, cores if pid == 0 and caller.endswith(_RESERVING_MODULE) else mask)

    os.sched_setaffinity = sched_setaffinity


def _cores(spec: str) -> set[int]:
    """"0", "0,1", "0-1" or vLLM's per-rank "0|1" as a set of core numbers."""
    cores: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def install() -> None:
    """Register what the environment asks for (called from the `.pth` line)."""
    patches: dict[str, Patch] = {}
    if delay := os.environ.get(_DELAY_ENV):
        patches.update(dict.fromkeys(_NIXL_API_MODULES, _delay_patch(int(delay))))
    spin, recheck = os.environ.get(_SPIN_ENV), os.environ.get(_RECHECK_ENV)
    if spin or recheck:
        patches[_MQ_MODULE] = _queue_patch(float(spin) if spin else None,
                                           int(recheck) if recheck else None)
    if patches and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(patches))
    if spec := os.environ.get(_CORES_ENV):
        cores = _cores(spec)
        # Every process of the engine starts here (API server, engine core, workers: each
        # a fresh interpreter), before any of its threads: the whole tree stays on them.
        os.sched_setaffinity(0, cores)
        _pin_reserved_core(cores)


install()
