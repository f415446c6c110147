"""The router's instructions per request under callgrind: a figure a busy machine cannot blur.

Each checkout's router (`--root`, repeatable; default this checkout) runs pull-mode P/D
under `valgrind --tool=callgrind --instr-atstart=no` in front of bench/peers.py's nginx
engines (round-robin, max_tokens 16). After `--warmup` requests, collection is switched on
(`callgrind_control -i on`) for exactly `--requests` requests from `--connections`
keep-alive connections, then off; the user-space instructions collected (callgrind's
`Collected :` line at exit), divided by the request count, are the row. Two copies of the
same code agree within ~1 %, so commits can be compared on a loaded 2-core machine where
timings (bench/peers.py) cannot.

    python bench/instructions.py [--root DIR ...] [--words 200,2000]
                                 [--formats json,sse,json-migrating,sse-migrating]
                                 [--policies round-robin,round-robin-dp2]
                                 [--requests 400] [--warmup 200] [--connections 4]

`--formats json-migrating` measures a non-streaming request that mid-stream migration
serves as a stream (`--migrate-non-streaming`, a router with a tokenizer; its decode engine
lists token ids per chunk); `json` is the same request served plainly. `sse-migrating`: a
stream that may migrate (a router with a tokenizer: on by default), its decode engine
listing token ids; `sse` is a stream with neither.

Needs valgrind (apt-get install valgrind) and nginx (as bench/peers.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parent.parent


def send(port: int, body: bytes, total: int, connections: int) -> None:
    """`total` POSTs over `connections` keep-alive connections, each answer read whole;
    any status but 200 stops the run."""
    share = [total // connections + (i < total % connections) for i in range(connections)]
    errors: list[str] = []

    def worker(n: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for _ in range(n):
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                errors.append(f"HTTP {resp.status}")
                return
        conn.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in share]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"the router answered {errors[0]}")


def collected(log: Path) -> int:
    """Instructions callgrind collected: the `Collected :` line it logs at exit."""
    m = re.search(r"Collected : (\d+)", log.read_text(errors="replace"))
    return int(m[1]) if m else 0


def measure(root: Path, ports: dict[str, int], fmt: str, words: int, policy: str,
            args: argparse.Namespace, tmp: Path) -> float:
    """Instructions per request of `root`'s router for one prompt size, format and
    policy (bench/peers.py's names: round-robin, round-robin-dp2, cache-aware)."""
    port = peers.free_port()
    out = tmp / f"cg-{root.name}-{fmt}-{words}-{policy}.out"
    migrating = fmt.endswith("-migrating")
    stream = fmt.startswith("sse")
    decode = ports["sse-ids"] if migrating else ports[fmt]
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            *peers.pdgate_argv(port, ports["prefill"], decode, 1, policy, args),
            *(["--tokenizer", str(_tokenizer(tmp)), "--migrate-non-streaming"]
              if migrating else [])]
    # A fixed hash seed: dict and set layouts (and so the work) the same in every run.
    env = {**peers.pdgate_env(root), "PYTHONHASHSEED": "0"}
    proc = peers.spawn(argv, None, tmp / f"{out.name}.log", env=env, cwd=root)
    try:
        peers.wait_serving(port, proc, stream=stream, timeout=300.0)
        body = json.dumps({"model": "pdgate-tiny", "prompt": peers.prompt_of(words),
                           "max_tokens": peers.MAX_TOKENS, "stream": stream}).encode()
        send(port, body, args.warmup, args.connections)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                       capture_output=True)
        send(port, body, args.requests, args.connections)
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True,
                       capture_output=True)
    finally:
        peers.stop(proc)
    log = tmp / f"{out.name}.log"
    if (n := collected(log)) == 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"callgrind collected nothing for {root}:\n{tail}")
    return float(n / args.requests)


def _tokenizer(tmp: Path) -> Path:
    """The tiny model's tokenizer in `tmp` (built once): with one, the router may migrate
    requests (mid-stream migration needs the prompt's ids)."""
    out = tmp / "tokenizer"
    if not out.is_dir():
        from pdgate.engine_shim.tiny import build_tiny_tokenizer
        build_tiny_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append",
                   help="a checkout whose router is measured (repeatable; default: this one)")
    p.add_argument("--words", type=lambda s: [int(w) for w in s.split(",")], default=[200])
    p.add_argument("--formats", default="json,sse",
                   help="comma-separated: json, sse, json-migrating (a non-streaming request "
                        "to a router with --migrate-non-streaming and a tokenizer: served as "
                        "a stream listing token ids, which the router assembles), "
                        "sse-migrating (a stream that may migrate, its ids listed)")
    p.add_argument("--policies", default="round-robin",
                   help="comma-separated, bench/peers.py's: round-robin, round-robin-dp2 "
                        "(every engine as 2 DP ranks: the cost of rank pinning), cache-aware")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--nginx", help="nginx binary (default: on PATH, else apt-get install)")
    args = p.parse_args(argv)
    roots = [Path(r).resolve() for r in args.root or [str(ROOT)]]
    print(f"{'checkout':<24}{'policy':<17}{'words':>6} {'fmt':<5}{'k instructions/req':>20}")
    with peers.nginx_engines(None, args.nginx, None) as ports, \
            tempfile.TemporaryDirectory(prefix="pdgate-instr-") as tmp:
        for words in args.words:
            for fmt in args.formats.split(","):
                for policy in args.policies.split(","):
                    for root in roots:
                        per = measure(root, ports, fmt, words, policy, args, Path(tmp))
                        print(f"{root.name:<24}{policy:<17}{words:>6} {fmt:<5}"
                              f"{per / 1e3:>20.0f}", flush=True)


if __name__ == "__main__":
    main()
