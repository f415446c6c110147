"""NIXL READ throughput of one paged KV request between two agents in TWO processes (CPU DRAM).

The "P" process owns a KV buffer filled with known bytes, registers it and serves (polls
notifications, which also drives UCX progress). The "D" process (this one) reads one
request's blocks from it, per block size, in these ways:

- `paged_coalesced`: per-block descriptor lists prepared once; the request's (layer, K|V,
  block) indices are handed to NIXL, which merges adjacent blocks (one descriptor per
  (layer, K|V, run)). This is what `KVConnector.pull` does.
- `paged_regions`: per-request coalesced region lists (`kv_layout.region_list`), built and
  prepared for each request (`initialize_xfer`).
- `paged_uncoalesced`: the prepared per-block lists with merging off (one descriptor per block).
- `contiguous`: one region holding the same number of bytes.
- `memcpy`: torch `copy_` of the same bytes inside this process.

Times (`ms`, GB/s) cover building the transfer request (`make_us` alone), posting it and
polling it to completion. Each figure is the median of `--iters` runs after one warm-up;
bytes are checked after each mode.

    .venv/bin/python bench/kv_transfer.py [--tokens 2048] [--block-sizes 16,32,64] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_shim.kv_layout import KVLayout, coalesce_pairs, region_list  # noqa: E402
from engine_shim.nixl_agent import NixlAgent, PreppedList, Xfer  # noqa: E402

SEED = 1234


@dataclass(frozen=True)
class Geometry:
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    pool_factor: int  # pool blocks = pool_factor * request blocks

    def layout(self, block_size: int) -> KVLayout:
        blocks = self.pool_factor * (self.tokens // block_size)
        return KVLayout(self.layers, blocks, block_size, self.kv_heads, self.head_dim, self.dtype)


def _fill(nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def serve_p(conn: Connection, nbytes: int) -> None:
    """P process: register a buffer of known bytes, hand out metadata, poll until told."""
    buf = _fill(nbytes)
    agent = NixlAgent("bench-P")
    agent.register(buf.data_ptr(), nbytes, "DRAM", 0)
    conn.send((agent.metadata(), buf.data_ptr()))
    while not conn.poll(0.001):
        agent.get_notifs()
    conn.recv()
    agent.deregister()


def wait(agent: NixlAgent, xfer: Xfer) -> None:
    state = agent.post(xfer)
    while state == "PROC":
        state = agent.state(xfer)
    if state != "DONE":
        raise RuntimeError(f"transfer ended in state {state}")


def timed(run: Callable[[], Xfer], agent: NixlAgent, nbytes: int, iters: int) -> dict[str, Any]:
    """Median seconds of make+post+wait (and of make alone), GB/s and NIXL's descriptor count."""
    times: list[float] = []
    makes: list[float] = []
    descs = 0
    for i in range(iters + 1):
        t0 = time.perf_counter()
        xfer = run()
        t1 = time.perf_counter()
        wait(agent, xfer)
        dt = time.perf_counter() - t0
        descs = agent.telemetry(xfer)[2]
        agent.release(xfer)
        if i:
            times.append(dt)
            makes.append(t1 - t0)
    secs = statistics.median(times)
    return {"seconds": secs, "gbps": nbytes / secs / 1e9, "descriptors": descs,
            "make_us": statistics.median(makes) * 1e6}


class Reader:
    """D side for one block size: per-block prepared lists on both sides, made once."""

    def __init__(self, agent: NixlAgent, peer: str, layout: KVLayout, local_base: int,
                 remote_base: int) -> None:
        self.agent, self.peer, self.layout = agent, peer, layout
        every = [(b, 1) for b in range(layout.num_blocks)]
        self.local: PreppedList = agent.prep_local(
            region_list(layout, local_base, every), "DRAM", 0)
        self.remote: PreppedList = agent.prep_remote(
            peer, region_list(layout, remote_base, every), "DRAM", 0)
        self.local_base, self.remote_base = local_base, remote_base

    def indices(self, blocks: list[int]) -> np.ndarray:
        lay = self.layout
        per_kv = np.arange(lay.num_layers * 2, dtype=np.int64)[:, None] * lay.num_blocks
        return (per_kv + np.asarray(blocks, dtype=np.int64)[None, :]).ravel().astype(np.int32)

    def prepped(self, local: list[int], remote: list[int], merge: bool) -> Xfer:
        nbytes = len(local) * self.layout.block_bytes * self.layout.num_layers * 2
        return self.agent.make_xfer("READ", self.local, self.indices(local), self.remote,
                                    self.indices(remote), b"", nbytes, merge=merge)

    def regions(self, local: list[int], remote: list[int]) -> Xfer:
        runs = list(coalesce_pairs(local, remote))
        lr = region_list(self.layout, self.local_base, [(lo, n) for lo, _, n in runs])
        rr = region_list(self.layout, self.remote_base, [(ro, n) for _, ro, n in runs])
        return self.agent.make_xfer_regions("READ", lr, "DRAM", 0, self.peer, rr, "DRAM", 0, b"")

    def close(self) -> None:
        self.agent.release_list(self.local)
        self.agent.release_list(self.remote)


def check_blocks(dst: torch.Tensor, src: torch.Tensor, layout: KVLayout, local: list[int],
                 remote: list[int]) -> None:
    shape = (layout.num_layers, 2, layout.num_blocks, layout.block_bytes)
    d, s = dst.view(shape), src.view(shape)
    if not torch.equal(d[:, :, local], s[:, :, remote]):
        raise AssertionError("transferred bytes differ from the source bytes")


def bench_block_size(ctx: dict[str, Any], geo: Geometry, bs: int, iters: int) -> dict[str, Any]:
    agent, peer, dst, src = ctx["agent"], ctx["peer"], ctx["dst"], ctx["src"]
    layout = geo.layout(bs)
    n = geo.tokens // bs
    remote = list(range(n))                  # P's request: its first n blocks
    local = list(range(n // 2, n // 2 + n))  # D reads them into other (consecutive) blocks
    nbytes = n * layout.block_bytes * layout.num_layers * 2
    reader = Reader(agent, peer, layout, dst.data_ptr(), ctx["remote_base"])
    modes: dict[str, Callable[[], Xfer]] = {
        "paged_coalesced": lambda: reader.prepped(local, remote, True),
        "paged_regions": lambda: reader.regions(local, remote),
        "paged_uncoalesced": lambda: reader.prepped(local, remote, False),
    }
    out: dict[str, Any] = {"block_size": bs, "bytes": nbytes, "blocks": n}
    for name, run in modes.items():
        dst.zero_()
        out[name] = timed(run, agent, nbytes, iters)
        check_blocks(dst, src, layout, local, remote)
    reader.close()
    return out


def bench_flat(ctx: dict[str, Any], nbytes: int, iters: int) -> dict[str, Any]:
    """Contiguous NIXL read and memcpy of `nbytes` (independent of block size)."""
    agent: NixlAgent = ctx["agent"]
    dst, src = ctx["dst"], ctx["src"]
    dst.zero_()

    def contiguous() -> Xfer:
        return agent.make_xfer_regions("READ", [(dst.data_ptr(), nbytes)], "DRAM", 0,
                                       ctx["peer"], [(ctx["remote_base"], nbytes)], "DRAM", 0,
                                       b"")
    contig = timed(contiguous, agent, nbytes, iters)
    if not torch.equal(dst[:nbytes], src[:nbytes]):
        raise AssertionError("contiguous read differs from the source bytes")
    copies: list[float] = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        dst[:nbytes].copy_(src[:nbytes])
        if i:
            copies.append(time.perf_counter() - t0)
    mc = statistics.median(copies)
    return {
        "contiguous": contig,
        "memcpy": {"seconds": mc, "gbps": nbytes / mc / 1e9},
    }


def run(geo: Geometry, block_sizes: list[int], iters: int) -> dict[str, Any]:
    nbytes = geo.layout(block_sizes[0]).total_bytes
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=serve_p, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        metadata, remote_base = parent.recv()
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        agent = NixlAgent("bench-D", telemetry=True)
        agent.register(dst.data_ptr(), nbytes, "DRAM", 0)
        ctx = {"agent": agent, "peer": agent.add_remote(metadata), "dst": dst,
               "src": _fill(nbytes), "remote_base": remote_base}
        request_bytes = geo.tokens * geo.layers * 2 * geo.kv_heads * geo.head_dim * \
            geo.layout(block_sizes[0]).element_size
        result: dict[str, Any] = {"geometry": geo.__dict__, "request_bytes": request_bytes,
                                  "transport": "NIXL UCX, DRAM, two processes on one host"}
        result.update(bench_flat(ctx, request_bytes, iters))
        result["per_block_size"] = [bench_block_size(ctx, geo, bs, iters) for bs in block_sizes]
        agent.remove_remote(ctx["peer"])
        agent.deregister()
        parent.send("stop")
        proc.join(10)
        return result
    finally:
        if proc.is_alive():
            proc.kill()


def table(r: dict[str, Any]) -> str:
    g = r["geometry"]
    contig, mc = r["contiguous"]["gbps"], r["memcpy"]["gbps"]
    lines = [
        f"request: {g['tokens']} tokens x {g['layers']} layers x {g['kv_heads']} kv heads x "
        f"{g['head_dim']} dims {g['dtype']} = {r['request_bytes'] / 2**20:.0f} MiB; "
        f"{r['transport']}",
        f"contiguous NIXL READ: {contig:6.2f} GB/s (1 descriptor)   memcpy: {mc:6.2f} GB/s",
        "",
        f"{'block':>5} {'mode':<18} {'descs':>6} {'make_us':>8} {'ms':>7} {'GB/s':>7} "
        f"{'/contig':>8} {'/memcpy':>8}",
    ]
    for row in r["per_block_size"]:
        for mode in ("paged_coalesced", "paged_regions", "paged_uncoalesced"):
            m = row[mode]
            lines.append(
                f"{row['block_size']:>5} {mode:<18} {m['descriptors']:>6} "
                f"{m['make_us']:>8.0f} {m['seconds'] * 1e3:>7.1f} {m['gbps']:>7.2f} "
                f"{m['gbps'] / contig:>8.2f} {m['gbps'] / mc:>8.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--block-sizes", default="16,32,64")
    p.add_argument("--pool-factor", type=int, default=2, help="pool blocks per request block")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object as last line")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.block_sizes.split(",")]
    if any(a.tokens % s for s in sizes):
        p.error("--tokens must be a multiple of every block size")
    geo = Geometry(a.tokens, a.layers, a.kv_heads, a.head_dim, a.dtype, a.pool_factor)
    result = run(geo, sizes, a.iters)
    print(table(result))
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
