"""NIXL READ and WRITE of one paged KV request between two agents in TWO processes.

The "P" process owns a KV buffer filled with known bytes, registers it with NIXL (DRAM on
`--device cpu`, VRAM on `--device cuda`; `--p-device N` puts P on another GPU) and serves:
it polls notifications (which also drives UCX progress) and answers zero/check commands on a
pipe. The "D" process (this one) moves one request's blocks (P's first n blocks <-> n
consecutive D blocks elsewhere in its pool) for every op (READ: P->D, WRITE: D->P), block
size and request length, in these ways:

- `per_block`: per-block descriptor lists prepared once, merging off: one descriptor per
  (layer, K|V, block), what a transfer of scattered blocks costs.
- `coalesced`: the same prepared lists; NIXL merges blocks adjacent on both sides (one
  descriptor per (layer, K|V, run)). This is what `KVConnector` does.
- `regions`: per-request coalesced region lists (`kv_layout.region_list`), prepared for each
  request (`initialize_xfer`).
- `contiguous`: one region holding the same number of bytes (the NIXL ceiling).
- `device_copy`: a torch `copy_` of the same bytes in this process (cuda: P's GPU -> D's GPU;
  cpu: memcpy), the hardware reference.

`--kv-layouts` picks where a block lives (the shim's `kv_layout.KVLayout` layouts, the same
descriptor lists the shim prepares): `block` is block-major, the shim's default
(`[blocks, layers, K|V, ...]`: a run of blocks of all layers is ONE region), `layer` is
layer-major (`pdgate shim --kv-layout layer`, `[layers, K|V, blocks, ...]`: a run of blocks is
layers*2 regions, 64 for Llama-3-8B), to show what the per-descriptor cost leaves on the table.

Figures: `prep_ms` builds the pool-wide per-block lists once per peer (both sides); per
request `make_us` builds the transfer request, `xfer_ms` posts it and polls it to DONE, `ms`
is both. Each figure is the median of `--iters` runs after one warm-up (per_block runs of
more than 4096 descriptors: at most 3); bytes are checked after each mode.

    .venv/bin/python bench/kv_transfer.py                        # CPU DRAM (CI covers it)
    python bench/kv_transfer.py --device cuda [--p-device 1] --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdgate.engine_shim.kv_layout import LAYOUTS, KVLayout, coalesce_pairs, region_list  # noqa: E402
from pdgate.engine_shim.kv_reader import block_indices, per_block_regions  # noqa: E402
from pdgate.engine_shim.nixl_agent import MemType, NixlAgent, PreppedList, Xfer, XferOp  # noqa: E402

SEED_P, SEED_D = 1234, 4321
MODES = ("per_block", "coalesced", "regions", "contiguous")
BIG_LIST = 4096  # descriptors above which per_block runs at most 3 times


@dataclass(frozen=True)
class Setup:
    device: str  # "cpu" | "cuda"
    d_dev: int
    p_dev: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens: tuple[int, ...]
    block_sizes: tuple[int, ...]
    kv_layouts: tuple[str, ...]
    ops: tuple[str, ...]
    pool_factor: int
    iters: int

    @property
    def mem(self) -> MemType:
        return "VRAM" if self.device == "cuda" else "DRAM"

    def layout(self, block_size: int, kind: str = "layer") -> KVLayout:
        blocks = self.pool_factor * (max(self.tokens) // block_size)
        return KVLayout(self.layers, blocks, block_size, self.kv_heads, self.head_dim, self.dtype,
                        layout=LAYOUTS[kind])

    def pool_bytes(self) -> int:
        return self.layout(self.block_sizes[0]).total_bytes


@dataclass(frozen=True)
class Placement:
    """Where the blocks of `lay`'s pool live (see module doc): "layer" or "block"-major."""

    kind: str
    lay: KVLayout

    @property
    def slab(self) -> int:
        """Bytes of one block across all layers and K/V."""
        return self.lay.num_layers * 2 * self.lay.block_bytes

    def pool_regions(self, base: int) -> list[tuple[int, int]]:
        """Per-block descriptors of the whole pool, in the order `indices` numbers them (the
        shim's own lists: one per block in block-major, per (layer, K|V, block) else)."""
        return per_block_regions(self.lay, base)

    def indices(self, blocks: list[int]) -> npt.NDArray[np.int32]:
        return block_indices(self.lay, blocks)

    def run_regions(self, base: int, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return region_list(self.lay, base, runs)

    def check_view(self) -> tuple[tuple[int, ...], int]:
        """(shape, block dim) of a byte view of the pool, for comparing blocks."""
        lay = self.lay
        if self.kind == "layer":
            return (lay.num_layers, 2, lay.num_blocks, lay.block_bytes), 2
        return (lay.num_blocks, self.slab), 0


def torch_device(device: str, index: int) -> torch.device:
    return torch.device("cuda", index) if device == "cuda" else torch.device("cpu")


def pattern(nbytes: int, device: torch.device, seed: int) -> torch.Tensor:
    """`nbytes` pseudo-random bytes, the same for the same seed in any process."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)


def sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def blocks_equal(a: torch.Tensor, b: torch.Tensor, view: tuple[tuple[int, ...], int],
                 a_blocks: list[int], b_blocks: list[int]) -> bool:
    """a's blocks `a_blocks` == b's blocks `b_blocks` (view: `Placement.check_view()`)."""
    shape, dim = view

    def pick(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return t.view(shape).index_select(dim, torch.tensor(ids, device=t.device))
    return torch.equal(pick(a, a_blocks), pick(b, b_blocks))


def serve_p(conn: Connection, nbytes: int, device: str, dev: int, mem: MemType) -> None:
    """P process: register a buffer of P's bytes, hand out metadata, answer commands."""
    tdev = torch_device(device, dev)
    if tdev.type == "cuda":
        torch.cuda.set_device(tdev)
    buf = pattern(nbytes, tdev, SEED_P)
    d_bytes: torch.Tensor | None = None  # D's pattern, made on the first WRITE check
    agent = NixlAgent("bench-P", vram=mem == "VRAM")
    agent.register(buf.data_ptr(), nbytes, mem, dev)
    conn.send((agent.metadata(), buf.data_ptr()))
    while True:
        while not conn.poll(0.001):
            agent.get_notifs()
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "zero":
            buf.zero_()
            sync(buf)
            conn.send(True)
        elif cmd[0] == "check":  # ("check", view, P blocks, D blocks) or ("check", n)
            d_bytes = pattern(nbytes, tdev, SEED_D) if d_bytes is None else d_bytes
            if len(cmd) == 2:
                conn.send(torch.equal(buf[: cmd[1]], d_bytes[: cmd[1]]))
            else:
                conn.send(blocks_equal(buf, d_bytes, cmd[1], cmd[2], cmd[3]))
    agent.deregister()


class Bench:
    """D side: the agent, its buffer, P's pattern (to check READs) and the pipe to P."""

    def __init__(self, s: Setup, conn: Connection) -> None:
        self.s, self.conn = s, conn
        self.tdev = torch_device(s.device, s.d_dev)
        nbytes = s.pool_bytes()
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.tdev)
        self.p_bytes = pattern(nbytes, torch_device(s.device, s.p_dev), SEED_P)
        self.d_bytes = pattern(nbytes, self.tdev, SEED_D)
        metadata_, self.remote_base = conn.recv()
        self.agent = NixlAgent("bench-D", telemetry=True, vram=s.device.startswith("cuda"))
        self.agent.register(self.buf.data_ptr(), nbytes, s.mem, s.d_dev)
        self.peer = self.agent.add_remote(metadata_)

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def reset(self, op: str) -> None:
        """READ: zero D's buffer. WRITE: D's buffer holds D's bytes, P's is zeroed."""
        if op == "READ":
            self.buf.zero_()
        else:
            self.buf.copy_(self.d_bytes)
            self.ask("zero")
        sync(self.buf)

    def check(self, op: str, view: tuple[tuple[int, ...], int] | None, local: list[int],
              remote: list[int], nbytes: int) -> None:
        if op == "READ":
            ok = torch.equal(self.buf[:nbytes], self.p_bytes[:nbytes].to(self.tdev)) \
                if view is None else blocks_equal(self.buf, self.p_bytes.to(self.tdev), view,
                                                  local, remote)
        else:
            ok = self.ask("check", nbytes) if view is None else \
                self.ask("check", view, remote, local)
        if not ok:
            raise AssertionError(f"{op}: transferred bytes differ from the source bytes")

    def wait(self, xfer: Xfer) -> None:
        state = self.agent.post(xfer)
        while state == "PROC":
            state = self.agent.state(xfer)
        if state != "DONE":
            raise RuntimeError(f"transfer ended in state {state}")

    def timed(self, make: Callable[[], Xfer], nbytes: int, iters: int) -> dict[str, float]:
        """Medians of make (µs), post+wait (ms) and both (ms); GB/s; NIXL's descriptors."""
        makes, xfers, totals = [], [], []
        descs = 0
        for i in range(iters + 1):
            t0 = time.perf_counter()
            xfer = make()
            t1 = time.perf_counter()
            self.wait(xfer)
            t2 = time.perf_counter()
            descs = self.agent.telemetry(xfer)[2]
            self.agent.release(xfer)
            if i:
                makes.append(t1 - t0)
                xfers.append(t2 - t1)
                totals.append(t2 - t0)
        total = statistics.median(totals)
        return {"descriptors": descs, "make_us": statistics.median(makes) * 1e6,
                "xfer_ms": statistics.median(xfers) * 1e3, "ms": total * 1e3,
                "gbps": nbytes / total / 1e9}

    def device_copy(self, nbytes: int) -> dict[str, float]:
        """torch copy of `nbytes` from P's device to D's (the hardware reference)."""
        src, dst = self.p_bytes[:nbytes], self.buf[:nbytes]
        times = []
        for i in range(self.s.iters + 1):
            sync(src)
            t0 = time.perf_counter()
            dst.copy_(src)
            sync(dst)
            if i:
                times.append(time.perf_counter() - t0)
        secs = statistics.median(times)
        return {"ms": secs * 1e3, "gbps": nbytes / secs / 1e9}

    def close(self) -> None:
        self.agent.remove_remote(self.peer)
        self.agent.deregister()


class Lists:
    """Per-block descriptor lists of the whole pool on both sides, prepared once (timed)."""

    def __init__(self, b: Bench, place: Placement) -> None:
        self.b, self.place, self.layout = b, place, place.lay
        t0 = time.perf_counter()
        self.local: PreppedList = b.agent.prep_local(
            place.pool_regions(b.buf.data_ptr()), b.s.mem, b.s.d_dev)
        t1 = time.perf_counter()
        self.remote: PreppedList = b.agent.prep_remote(
            b.peer, place.pool_regions(b.remote_base), b.s.mem, b.s.p_dev)
        t2 = time.perf_counter()
        self.prep = {"descriptors_per_side": self.local.size, "local_ms": (t1 - t0) * 1e3,
                     "remote_ms": (t2 - t1) * 1e3}

    def prepped(self, op: XferOp, local: list[int], remote: list[int], merge: bool) -> Xfer:
        lay = self.layout
        nbytes = len(local) * lay.block_bytes * lay.num_layers * 2
        return self.b.agent.make_xfer(op, self.local, self.place.indices(local), self.remote,
                                      self.place.indices(remote), b"", nbytes, merge=merge)

    def regions(self, op: XferOp, local: list[int], remote: list[int]) -> Xfer:
        b, place = self.b, self.place
        runs = list(coalesce_pairs(local, remote))
        lr = place.run_regions(b.buf.data_ptr(), [(lo, n) for lo, _, n in runs])
        rr = place.run_regions(b.remote_base, [(ro, n) for _, ro, n in runs])
        return b.agent.make_xfer_regions(op, lr, b.s.mem, b.s.d_dev, b.peer, rr, b.s.mem,
                                         b.s.p_dev, b"")

    def contiguous(self, op: XferOp, nbytes: int) -> Xfer:
        b = self.b
        return b.agent.make_xfer_regions(op, [(b.buf.data_ptr(), nbytes)], b.s.mem, b.s.d_dev,
                                         b.peer, [(b.remote_base, nbytes)], b.s.mem, b.s.p_dev,
                                         b"")

    def close(self) -> None:
        self.b.agent.release_list(self.local)
        self.b.agent.release_list(self.remote)


def bench_request(lists: Lists, op: XferOp, tokens: int) -> dict[str, Any]:
    """Every mode for one request of `tokens` tokens."""
    b, lay = lists.b, lists.layout
    n = tokens // lay.block_size
    remote = list(range(n))                  # P's request: its first n blocks
    local = list(range(n // 2, n // 2 + n))  # D's side: other (consecutive) blocks
    nbytes = n * lay.block_bytes * lay.num_layers * 2
    view = lists.place.check_view()
    runs: dict[str, Callable[[], Xfer]] = {
        "per_block": lambda: lists.prepped(op, local, remote, False),
        "coalesced": lambda: lists.prepped(op, local, remote, True),
        "regions": lambda: lists.regions(op, local, remote),
        "contiguous": lambda: lists.contiguous(op, nbytes),
    }
    row: dict[str, Any] = {"op": op, "kv_layout": lists.place.kind,
                           "block_size": lay.block_size, "tokens": tokens, "bytes": nbytes,
                           "blocks": n}
    for mode, make in runs.items():
        iters = b.s.iters
        if mode == "per_block" and len(lists.place.indices(local)) > BIG_LIST:
            iters = min(iters, 3)
        b.reset(op)
        row[mode] = b.timed(make, nbytes, iters)
        try:
            b.check(op, None if mode == "contiguous" else view, local, remote, nbytes)
        except AssertionError as e:
            raise AssertionError(f"{lists.place.kind}-major {mode} {tokens} tokens: {e}") from e
    row["device_copy"] = b.device_copy(nbytes)
    for mode in MODES:
        row[mode]["vs_contiguous"] = row[mode]["gbps"] / row["contiguous"]["gbps"]
        row[mode]["vs_device_copy"] = row[mode]["gbps"] / row["device_copy"]["gbps"]
    return row


def nixl_version() -> str:
    """The installed NIXL distribution's version: `nixl` (the meta package), or the
    `nixl-cu13`/`nixl-cu12` build alone (the shim extra installs nixl-cu13)."""
    for name in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return f"{metadata.version(name)} ({name})"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def environment(s: Setup) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__, "nixl": nixl_version(),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "python": sys.version.split()[0],
    }
    if s.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(s.d_dev)
        env["p_gpu"] = torch.cuda.get_device_name(s.p_dev)
        env["cuda"] = torch.version.cuda
        env["transport"] = (f"NIXL UCX VRAM, two processes, P on cuda:{s.p_dev}, "
                            f"D on cuda:{s.d_dev}")
    else:
        env["transport"] = "NIXL UCX DRAM, two processes on one host"
    return env


def run(s: Setup) -> dict[str, Any]:
    # UCX reads this when the agents start; the shim's NixlAgent sets the same default.
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_p, daemon=True,
                       args=(child, s.pool_bytes(), s.device, s.p_dev, s.mem))
    proc.start()
    try:
        if s.device == "cuda":
            torch.cuda.set_device(s.d_dev)
        else:  # a pooled memcpy measures thread wake-ups on a busy host, not the copy
            torch.set_num_threads(1)
        b = Bench(s, parent)
        result: dict[str, Any] = {"setup": asdict(s), "env": environment(s), "rows": []}
        all_lists = [Lists(b, Placement(kind, s.layout(bs, kind)))
                     for kind in s.kv_layouts for bs in s.block_sizes]
        result["prep"] = [{"kv_layout": ls.place.kind, "block_size": ls.layout.block_size,
                           **ls.prep} for ls in all_lists]
        for op in s.ops:  # every READ first: a WRITE overwrites P's bytes
            for lists in all_lists:
                for tokens in s.tokens:
                    result["rows"].append(bench_request(lists, cast(XferOp, op), tokens))
        for lists in all_lists:
            lists.close()
        b.close()
        parent.send(("stop",))
        proc.join(30)
        return result
    finally:
        if proc.is_alive():
            proc.kill()


def table(r: dict[str, Any]) -> str:
    s, env = r["setup"], r["env"]
    per_token = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * (4 if s["dtype"] == "float32"
                                                                    else 2)
    lines = [
        f"{env.get('gpu', 'CPU')}; {env['transport']}; torch {env['torch']}, nixl {env['nixl']}, "
        f"UCX env {env['ucx_env'] or 'defaults'}",
        f"cache: {s['layers']} layers x {s['kv_heads']} kv heads x {s['head_dim']} dims "
        f"{s['dtype']} = {per_token // 1024} KiB per token",
    ]
    for p in r["prep"]:
        lines.append(f"{p['kv_layout']}-major list prep once per peer (block {p['block_size']}, "
                     f"{p['descriptors_per_side']} descriptors a side): local "
                     f"{p['local_ms']:.1f} ms, remote {p['remote_ms']:.1f} ms")
    lines += ["", f"{'op':<5} {'major':<5} {'block':>5} {'tokens':>6} {'MiB':>5} {'mode':<11} "
              f"{'descs':>6} "
              f"{'make_us':>8} {'xfer_ms':>8} {'ms':>8} {'GB/s':>8} {'/contig':>7} {'/copy':>6}"]
    for row in r["rows"]:
        head = f"{row['op']:<5} {row['kv_layout']:<5} {row['block_size']:>5} {row['tokens']:>6} " \
               f"{row['bytes'] / 2**20:>5.0f}"
        for mode in MODES:
            m = row[mode]
            lines.append(f"{head} {mode:<11} {m['descriptors']:>6} {m['make_us']:>8.0f} "
                         f"{m['xfer_ms']:>8.3f} {m['ms']:>8.3f} {m['gbps']:>8.1f} "
                         f"{m['vs_contiguous']:>7.2f} {m['vs_device_copy']:>6.2f}")
        c = row["device_copy"]
        lines.append(f"{head} {'device_copy':<11} {'':>6} {'':>8} {'':>8} {c['ms']:>8.3f} "
                     f"{c['gbps']:>8.1f} {'':>7} {1.0:>6.2f}")
    return "\n".join(lines)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--d-device", type=int, default=0, help="D's GPU index (cuda)")
    p.add_argument("--p-device", type=int, default=None, help="P's GPU index (default: D's)")
    p.add_argument("--tokens", default=None,
                   help="request lengths, comma-separated (default: cpu 2048, cuda 512,2048,8192)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--block-sizes", default="16")
    p.add_argument("--kv-layouts", default="layer,block",
                   help="layer (the shim's KVLayout) and/or block (block-major, for comparison)")
    p.add_argument("--ops", default="READ,WRITE")
    p.add_argument("--pool-factor", type=int, default=2, help="pool blocks per request block")
    p.add_argument("--iters", type=int, default=None, help="default: cpu 5, cuda 20")
    p.add_argument("--json", action="store_true", help="print one JSON object as last line")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    tokens = ints(a.tokens or ("512,2048,8192" if cuda else "2048"))
    sizes = ints(a.block_sizes)
    ops = tuple(o.strip().upper() for o in a.ops.split(","))
    if any(t % bs for t in tokens for bs in sizes):
        p.error("every --tokens value must be a multiple of every block size")
    if not set(ops) <= {"READ", "WRITE"}:
        p.error("--ops takes READ and/or WRITE")
    layouts = tuple(k.strip() for k in a.kv_layouts.split(","))
    if not set(layouts) <= {"layer", "block"}:
        p.error("--kv-layouts takes layer and/or block")
    s = Setup(a.device, a.d_device, a.d_device if a.p_device is None else a.p_device,
              a.layers, a.kv_heads, a.head_dim, a.dtype, tokens, sizes, layouts, ops,
              a.pool_factor,
              a.iters or (20 if cuda else 5))
    result = run(s)
    print(table(result))
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
