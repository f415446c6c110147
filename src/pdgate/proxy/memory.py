"""Handing freed heap back to the OS once a flood of early arrivals has drained.

glibc keeps freed blocks for reuse; after the reaper drops ~100k entries the process would
stay at its flood size (bench/proxy.py: 93 MiB instead of 34). `malloc_trim(0)` returns
the free pages. Elsewhere (musl, macOS) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["heap_trimmer"]


def heap_trimmer() -> Callable[[], None] | None:
    """A function that returns free heap pages to the OS, or None where libc has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def run() -> None:
        trim(0)

    return run
