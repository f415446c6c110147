"""Start-up probe of the KV transport: a small READ and WRITE between two local NIXL agents.

Why: UCX picks its transport from process-wide settings, and a bad choice does not fail, it is
only slow. Measured on an H200 with nixl 1.5.1: without `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on` a
VRAM<-VRAM READ silently falls back to an emulated path over TCP loopback (~0.5 GB/s instead of
~1 TB/s over CUDA IPC). The probe moves a few MiB each way between two throw-away agents of this
process, with the engine's memory type and this process's UCX settings, checks the bytes,
measures GB/s, logs it, records it as metrics (`pdgate_shim_kv_probe_gbps{op}`,
`pdgate_shim_kv_probe_emulated`) and warns loudly when a figure looks emulated.

What it sees: the transport UCX chooses between two agents on this node for this memory type
(CUDA IPC for VRAM, shared memory for DRAM). It cannot see a path to another host or another
GPU. Two agents of one process reach each other over CUDA IPC only with
`UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y`, which the probe sets for its own agents alone (UCX reads
its environment when an agent's backend starts; the engine's agent is not affected).

The probe runs in the caller's thread and uses only its own agents (NIXL agents are not
thread-safe, but two agents are independent). It never raises: a failed probe is logged.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.nixl_agent import MemType, NixlAgent, Xfer, XferOp

log = logging.getLogger(__name__)

PROBE_BYTES = 8 << 20
"""Bytes per probe transfer: large enough that CUDA IPC shows ~100+ GB/s, small enough that
the emulated path (~0.5 GB/s) costs ~16 ms a transfer."""

MIN_GBPS: dict[str, float] = {"VRAM": 10.0, "DRAM": 0.5}
"""Below this a transfer looks emulated (VRAM: CUDA IPC gives hundreds of GB/s even for
8 MiB; a host bounce or TCP gives < 10). DRAM over shared memory gives several GB/s."""

_SAME_PROCESS_ENV = "UCX_CUDA_IPC_ENABLE_SAME_PROCESS"


@dataclass(frozen=True)
class ProbeResult:
    """GB/s (median of `iters` transfers of `nbytes` after a warm-up) per op ("read",
    "write"); `emulated` lists the ops below `min_gbps`; `seconds` is the probe's wall time."""

    mem_type: MemType
    device_id: int
    nbytes: int
    min_gbps: float
    gbps: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def emulated(self) -> list[str]:
        return [op for op, g in self.gbps.items() if g < self.min_gbps]

    def summary(self) -> str:
        figures = ", ".join(f"{op.upper()} {g:.1f} GB/s" for op, g in self.gbps.items())
        ucx = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        return (f"KV transport probe ({self.mem_type} device {self.device_id}, "
                f"{self.nbytes >> 20} MiB, two local NIXL/UCX agents): {figures}; "
                f"took {self.seconds * 1e3:.0f} ms; UCX env {ucx or 'defaults'}")


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set `name` unless the operator did, for the duration of the block."""
    old = os.environ.get(name)
    if old is None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)


def _on_device(mem_type: MemType, device_id: int) -> AbstractContextManager[object]:
    """The probe's GPU made current: same-process CUDA IPC needs it (measured on two H200s:
    probing GPU 1 from a thread on GPU 0 gave 0.3 GB/s, with GPU 1 current ~250-420 GB/s).
    Transfers between two processes do not depend on the current GPU (same figures)."""
    return torch.cuda.device(device_id) if mem_type == "VRAM" else nullcontext()


def _buffer(nbytes: int, mem_type: MemType, device_id: int) -> torch.Tensor:
    device = torch.device("cuda", device_id) if mem_type == "VRAM" else torch.device("cpu")
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _wait(agent: NixlAgent, peer: NixlAgent, xfer: Xfer, deadline: float) -> None:
    """Post and poll to DONE. The peer is polled too: an emulated path needs its progress."""
    state = agent.post(xfer)
    while state == "PROC":
        peer.get_notifs()
        if time.monotonic() > deadline:
            raise TimeoutError("probe transfer did not finish in time")
        state = agent.state(xfer)
    if state != "DONE":
        raise RuntimeError(f"probe transfer ended in state {state}")


def _measure(op: XferOp, a: NixlAgent, b: NixlAgent, peer: str, bufs: tuple[torch.Tensor, ...],
             mem_type: MemType, device_id: int, iters: int, deadline: float) -> float:
    """Median GB/s of `op` (issued by `a`) between a's bufs[0] and b's bufs[1]."""
    local, remote = bufs
    n = local.numel()
    src, dst = (remote, local) if op == "READ" else (local, remote)
    src.random_(0, 256)  # fresh bytes per op so the check below proves this op moved them
    dst.zero_()
    if mem_type == "VRAM":
        torch.cuda.synchronize(device_id)  # UCX copies on its own streams
    times: list[float] = []
    for i in range(iters + 1):  # the first transfer also connects: not timed
        xfer = a.make_xfer_regions(op, [(local.data_ptr(), n)], mem_type, device_id, peer,
                                   [(remote.data_ptr(), n)], mem_type, device_id, b"")
        t0 = time.perf_counter()
        try:
            _wait(a, b, xfer, deadline)
        finally:
            a.release(xfer)
        if i:
            times.append(time.perf_counter() - t0)
    if not torch.equal(src, dst):
        raise RuntimeError(f"probe {op} delivered different bytes")
    return n / statistics.median(times) / 1e9


def run_probe(mem_type: MemType, device_id: int = 0, *, name: str = "probe",
              nbytes: int = PROBE_BYTES, iters: int = 3, timeout: float = 10.0,
              min_gbps: float | None = None) -> ProbeResult:
    """Measure READ and WRITE between two fresh agents of this process (see module doc), with
    GPU `device_id` current for the probe's duration. Raises on failure (NixlAgentError,
    TimeoutError, RuntimeError); `probe_transport` wraps this for callers that must not fail."""
    with _on_device(mem_type, device_id):
        return _run_probe(mem_type, device_id, name, nbytes, iters, timeout, min_gbps)


def _run_probe(mem_type: MemType, device_id: int, name: str, nbytes: int, iters: int,
               timeout: float, min_gbps: float | None) -> ProbeResult:
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    bufs = (_buffer(nbytes, mem_type, device_id), _buffer(nbytes, mem_type, device_id))
    with _env(_SAME_PROCESS_ENV, "y"):
        vram = mem_type == "VRAM"
        a = NixlAgent(f"{name}-probe-a", vram=vram)
        b = NixlAgent(f"{name}-probe-b", vram=vram)
    a.register(bufs[0].data_ptr(), nbytes, mem_type, device_id)
    b.register(bufs[1].data_ptr(), nbytes, mem_type, device_id)
    peer = a.add_remote(b.metadata())
    try:
        gbps = {op.lower(): _measure(op, a, b, peer, bufs, mem_type, device_id, iters, deadline)
                for op in ("READ", "WRITE")}
    finally:
        a.remove_remote(peer)
        a.deregister()
        b.deregister()
    threshold = MIN_GBPS[mem_type] if min_gbps is None else min_gbps
    return ProbeResult(mem_type, device_id, nbytes, threshold, gbps,
                       time.perf_counter() - t0)


def probe_transport(mem_type: MemType, device_id: int, metrics: ShimMetrics | None, *,
                    name: str = "probe", min_gbps: float | None = None,
                    timeout: float = 10.0) -> ProbeResult | None:
    """`run_probe`, then log the figures (a loud warning when one looks emulated) and set
    the probe gauges. Never raises; returns None when the probe itself failed. Blocking
    (~50 ms on a healthy GPU, up to `timeout` on a broken path): call at start-up."""
    try:
        result = run_probe(mem_type, device_id, name=name, min_gbps=min_gbps,
                           timeout=timeout)
    except Exception as e:  # a probe must never keep the engine from starting
        log.warning("KV transport probe failed (%s: %s); transfer speed unknown",
                    type(e).__name__, e)
        if metrics is not None:
            metrics.kv_probe_emulated.set(-1)
        return None
    if metrics is not None:
        for op, g in result.gbps.items():
            metrics.kv_probe_gbps.labels(op=op).set(g)
        metrics.kv_probe_emulated.set(1 if result.emulated else 0)
    if result.emulated:
        log.warning(
            "SLOW KV TRANSPORT: %s below %.0f GB/s; UCX is probably using an emulated path "
            "(TCP or host bounce) instead of %s. KV transfers will be orders of magnitude "
            "slower than the hardware allows. Check UCX_TLS / UCX_CUDA_IPC_ENABLE_GET_ZCOPY. %s",
            "/".join(op.upper() for op in result.emulated), result.min_gbps,
            "CUDA IPC" if mem_type == "VRAM" else "shared memory", result.summary())
    else:
        log.info(result.summary())
    return result
