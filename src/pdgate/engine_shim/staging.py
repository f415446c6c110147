"""Host staging of KV transfers (`--kv-buffer-device cpu`, vLLM's `kv_buffer_device="cpu"`).

For devices whose memory NIXL cannot register (or a transport that only moves DRAM), the
engine registers a host buffer instead of its KV cache: `HostStaging.buffer` mirrors the
cache's layout block for block (block b of the cache is staged at block b of the mirror, so
the block pool's ownership protects the staging slots too: nobody reuses a staging block
while its device block is leased or being received). The sender copies the blocks it hands
over device -> host (`to_host`) before they are offered to a peer; the receiver copies the
landed blocks host -> device (`to_device`) before the model may read them.

Synchronisation on CUDA: the host mirror is pinned, copies run on one side stream with
`non_blocking=True` after `wait_stream` on the caller's current stream (so a D2H copy sees
every kernel that wrote the KV, and an H2D copy never overtakes kernels still reading the old
contents), and `stream.synchronize()` returns only once every byte moved, so a transfer is
posted (P) or the model scheduled (D) only after the copy finished. On CPU the copies are
plain synchronous copies. A run of consecutive blocks is one contiguous copy (block-major; one
per (layer, K|V) in the layer-major layout).
Copy time and bytes go to `pdgate_shim_kv_staging_{seconds,bytes_total}{direction}`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdgate.engine_shim.kv_cache import PagedKVCache
from pdgate.engine_shim.kv_layout import KVLayout

__all__ = ["BUFFER_DEVICES", "HostStaging", "block_runs", "create_staging"]

log = logging.getLogger(__name__)
BUFFER_DEVICES = ("cpu", "cuda")
_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) runs of consecutive ids among the distinct `block_ids` (sorted)."""
    runs: list[tuple[int, int]] = []
    for b in sorted(set(block_ids)):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class HostStaging:
    """A host mirror of `kv` that NIXL registers in its place (satisfies the connector's
    `KVMemory`). Thread-safe for copies of disjoint blocks: the engine calls `to_host` on the
    event-loop thread and `to_device` from worker threads."""

    def __init__(self, kv: PagedKVCache, registry: CollectorRegistry) -> None:
        self._kv = kv
        self._cuda = kv.device.type == "cuda"
        self.buffer = torch.zeros(kv.layout.shape, dtype=kv.buffer.dtype, device="cpu",
                                  pin_memory=self._cuda)
        self._stream: torch.cuda.Stream | None = None
        if self._cuda:  # copies overlap the model's work on the default stream
            self._stream = torch.cuda.Stream(device=kv.device)  # type: ignore[no-untyped-call]
        self._seconds = Histogram(
            "pdgate_shim_kv_staging_seconds", "Host staging copy time per transfer "
            "(to_host: device KV -> registered host buffer on the sender; to_device: landed "
            "host buffer -> device KV on the receiver)", ["direction"], registry=registry,
            buckets=_BUCKETS)
        self._bytes = Counter("pdgate_shim_kv_staging_bytes", "Bytes copied by host staging",
                              ["direction"], registry=registry)

    @property
    def layout(self) -> KVLayout:
        return self._kv.layout

    @property
    def base_addr(self) -> int:
        """Address of the host mirror (what NIXL registers)."""
        return int(self.buffer.data_ptr())

    @property
    def mem_type(self) -> str:
        return "DRAM"

    @property
    def device_id(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def to_host(self, block_ids: Sequence[int]) -> float:
        """Sender: copy `block_ids` (every layer, K and V) device -> host mirror; returns when
        the copy has finished. Returns the seconds it took."""
        return self._copy(block_ids, self._kv.buffer, self.buffer, "to_host")

    def to_device(self, block_ids: Sequence[int]) -> float:
        """Receiver: copy `block_ids` host mirror -> device once the transfer landed; returns
        when the device holds the bytes. Returns the seconds it took."""
        return self._copy(block_ids, self.buffer, self._kv.buffer, "to_device")

    def _copy(self, block_ids: Sequence[int], src: torch.Tensor, dst: torch.Tensor,
              direction: str) -> float:
        t0 = time.perf_counter()
        runs = block_runs(block_ids)
        pairs = [(d, s) for start, count in runs
                 for d, s in zip(self._slices(dst, start, count),
                                 self._slices(src, start, count), strict=True)]
        if self._stream is None:
            for d, s in pairs:
                d.copy_(s)
        else:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self._kv.device))
            with torch.cuda.stream(stream):
                for d, s in pairs:
                    d.copy_(s, non_blocking=True)
            stream.synchronize()  # nothing may use dst before every byte arrived
        elapsed = time.perf_counter() - t0
        nbytes = sum(c for _, c in runs) * self.layout.slab_bytes
        self._seconds.labels(direction=direction).observe(elapsed)
        self._bytes.labels(direction=direction).inc(nbytes)
        log.debug("staging %s: %d blocks, %d bytes in %.3f ms", direction,
                  sum(c for _, c in runs), nbytes, elapsed * 1e3)
        return elapsed


    def _slices(self, buffer: torch.Tensor, start: int, count: int) -> list[torch.Tensor]:
        """The contiguous pieces of `buffer` holding blocks start..start+count-1: one slab in
        block-major, one per (layer, K|V) in layer-major."""
        if self.layout.block_major:
            return [buffer[start:start + count]]
        return [buffer[layer, kv, start:start + count]
                for layer in range(self.layout.num_layers) for kv in (0, 1)]


def create_staging(kv: PagedKVCache, buffer_device: str | None,
                   registry: CollectorRegistry) -> HostStaging | None:
    """The staging buffer `--kv-buffer-device` asks for, or None when NIXL registers the KV
    cache itself (no flag, or the flag names the cache's own device type). "cpu" stages
    even a CPU engine's transfers (plain copies: the path GPU engines take, testable
    anywhere). Raises ValueError for a device the cache is not on (e.g. "cuda" for a CPU
    engine)."""
    if buffer_device is None:
        return None
    if buffer_device not in BUFFER_DEVICES:
        raise ValueError(f"--kv-buffer-device must be one of {BUFFER_DEVICES}, "
                         f"got {buffer_device!r}")
    if buffer_device == "cuda":
        if kv.device.type != "cuda":
            raise ValueError("--kv-buffer-device cuda needs a CUDA engine (--device cuda)")
        return None
    staging = HostStaging(kv, registry)
    log.info("KV host staging on: NIXL registers a %s host buffer of %.1f MiB; transfers "
             "copy %s <-> host", "pinned" if kv.device.type == "cuda" else "pageable",
             staging.nbytes / 2**20, kv.device)
    return staging
