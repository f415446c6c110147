"""Installed into the vLLM test venv (with a `.pth` line that imports it at interpreter start).

Why: nixl 1.5.1's Python `nixl_agent` hard-codes the progress thread's delay to 0 µs, so
every vLLM engine's NIXL agent spins a whole core even when idle; two engines on a 2-core
machine then slow decode about 10x. vLLM builds the agent through `nixl._api.nixl_agent`
and offers no knob for the delay, so this hook wraps the pybind `nixlAgent` constructor the
`_api` module calls and sets `pthrDelay` (µs) on the config it is given.

Active only when `PDGATE_NIXL_PTHR_DELAY_US` is set; it patches lazily, when the nixl
backend's `_api` module is first imported (so interpreters that never use nixl pay nothing).
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
_TARGETS = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"})


class _DelayedBindings(types.ModuleType):
    """Stands in for `nixl_*._bindings` inside `_api`: everything is the real module's,
    except `nixlAgent`, which first sets the progress-thread delay on its config."""

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


def install() -> None:
    """Register the import hook if the delay is configured (called from the `.pth` line)."""
    value = os.environ.get(_ENV)
    if value and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(int(value)))


install()
