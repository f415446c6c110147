"""pdgate vs vllm-router (Rust) in one run, behind the same fixed-response nginx engines.

Both routers run pull-mode P/D in front of one nginx "prefill engine" (answers any POST
with a vLLM completion carrying `kv_transfer_params`) and one nginx "decode engine" (a fixed
completion, or an SSE stream for the streaming rows). Each router is pinned to the same
core(s) with taskset; nginx and the load generator get other cores. Cases (`--cases`):

    rr       round-robin, one core, every prompt size, JSON and SSE
    dp       rr with each engine as 2 data-parallel ranks (pdgate --prefill-dp-size 2
             --decode-dp-size 2, vllm-router --intra-node-data-parallel-size 2): every leg
             carries X-data-parallel-rank; `x rr CPU` is the CPU per request over the same
             router's rr row (the cost of rank pinning)
    cache    prefix routing (pdgate prefix-text, vllm-router cache_aware), one core, JSON
    workers  round-robin on `--multi-cpus` cores (pdgate --workers N), JSON
    models   rr with two models behind one pdgate (`models:`, both on the same nginx
             engines), every request for the second one; pdgate only: vllm-router serves
             one model per P/D router. `x rr CPU` is its CPU per request over pdgate's rr
             row (the cost of the second model)

Per row: req/s, p50/p99 latency, the router's CPU time per request (utime + stime of the
router's whole process tree from /proc, over the measured run), pdgate's ratio to
vllm-router in the same case, and for the workers rows pdgate's ratio to its one-core row.

    python bench/peers.py [--duration 10] [--connections 32] [--words 5,200,2000]
                          [--cases rr,cache,workers] [--multi-cpus 0-3] [--reps 3]
                          [--base-root DIR] [--json]

The routers of a case run side by side on the same cores and every row measures them in
turn (`--reps` times, the median reported), so a host whose speed drifts during the run
shifts them alike; `--base-root` (repeatable) adds other checkouts' pdgate to the rr rows.

Needs: nginx (installed with apt-get when missing and running as root; or `--nginx PATH`),
vllm-router (pip, into a cached venv under .cache/, never the project's .venv; or
`--vllm-router COMMAND`), wrk when installed (or `--wrk PATH`; else an aiohttp load
generator in its own process). `--tool-libs DIR` is put on LD_LIBRARY_PATH for nginx and
wrk only (binaries copied from another machine with their shared libraries). The load
generator's own ceiling is measured straight against the decode nginx and printed: a row
near it is loadgen-bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_ROUTER = "vllm-router==0.1.17"
VENV = ROOT / ".cache" / "vllm-router-venv"
MAX_TOKENS = 16
_TICKS = os.sysconf("SC_CLK_TCK")

_PREFILL_REPLY = json.dumps({
    "id": "cmpl-p", "object": "text_completion", "created": 0, "model": "pdgate-tiny",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "nginx-p",
        "remote_request_id": "r", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1,
    },
}, separators=(",", ":"))
_DECODE_REPLY = json.dumps({
    "id": "cmpl-d", "object": "text_completion", "created": 0, "model": "pdgate-tiny",
    "choices": [{"index": 0, "text": " tok" * MAX_TOKENS, "finish_reason": "length",
                 "logprobs": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": MAX_TOKENS,
              "total_tokens": 8 + MAX_TOKENS},
}, separators=(",", ":"))
_SSE_CHUNK = ('data: {"id":"cmpl-d","object":"text_completion","created":0,'
              '"model":"pdgate-tiny","choices":[{"index":0,"text":" tok",'
              '"finish_reason":null,"logprobs":null}]}\n\n')
_SSE_REPLY = _SSE_CHUNK * MAX_TOKENS + "data: [DONE]\n\n"
# The same stream as a decode engine sends it to a router that tracks token ids (mid-stream
# migration asks for `return_token_ids` and the usage chunk): bench/instructions.py's
# `json-migrating` rows, a non-streaming request the router serves as such a stream.
_SSE_IDS_CHUNK = _SSE_CHUNK.replace('"logprobs":null}', '"logprobs":null,"token_ids":[7]}')
_SSE_IDS_REPLY = (_SSE_IDS_CHUNK * MAX_TOKENS
                  + 'data: {"id":"cmpl-d","object":"text_completion","created":0,'
                  '"model":"pdgate-tiny","choices":[],"usage":{"prompt_tokens":8,'
                  f'"completion_tokens":{MAX_TOKENS},"total_tokens":{8 + MAX_TOKENS}}}}}\n\n'
                  "data: [DONE]\n\n")


# ---------------------------------------------------------------- tools and processes

def ensure_vllm_router(venv: Path = VENV) -> Path:
    """Install `VLLM_ROUTER` into a cached venv (rebuilt when the pin changes); its CLI."""
    exe, stamp = venv / "bin" / "vllm-router", venv / ".pdgate-stamp"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists() and stamp.exists() and stamp.read_text() == VLLM_ROUTER:
            return exe
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", VLLM_ROUTER],
                             capture_output=True, text=True)
        if pip.returncode:
            raise SystemExit(f"pip install {VLLM_ROUTER} failed:\n{pip.stderr[-3000:]}")
        stamp.write_text(VLLM_ROUTER)
    return exe


def ensure_nginx() -> str:
    """nginx's path; installed from Debian when missing and running as root."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit("nginx is missing: apt-get install -y nginx (as root), then rerun")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "nginx"], check=True, env=env)
    return shutil.which("nginx", path="/usr/sbin:/usr/bin") or "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: list[str], cpus: str | None, log: Path | None = None,
          env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (child keeps it)
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                            start_new_session=True, env=env)


def tool_env(libs: str | None) -> dict[str, str] | None:
    """The environment of nginx and wrk: `libs` first on LD_LIBRARY_PATH (None: ours)."""
    if not libs:
        return None
    old = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": f"{libs}:{old}" if old else libs}


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _post(port: int, body: bytes, timeout: float = 2.0) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def wait_serving(port: int, proc: subprocess.Popen[bytes], timeout: float = 90.0,
                 stream: bool = False) -> None:
    """Until a completion through `port` answers 200 (the router has healthy engines)."""
    body = json.dumps({"model": "pdgate-tiny", "prompt": "hi", "max_tokens": 1,
                       "stream": stream}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        try:
            if _post(port, body) == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"nothing served on port {port} within {timeout:.0f} s")


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and every live descendant (router workers), in seconds."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total / _TICKS


# ---------------------------------------------------------------- engines (nginx)

def _nginx_conf(tmp: Path, ports: dict[str, int]) -> str:
    def server(port: int, ctype: str, body: str) -> str:
        quoted = body.replace("\\", "\\\\").replace("'", "\\'")
        return (f"  server {{ listen 127.0.0.1:{port} reuseport backlog=4096;\n"
                f"    keepalive_requests 1000000; client_body_buffer_size 1m;\n"
                f"    location = /health {{ default_type application/json; return 200 '{{}}'; }}\n"
                f"    location / {{ default_type {ctype}; return 200 '{quoted}'; }}\n  }}\n")

    user = "user root;\n" if os.geteuid() == 0 else ""
    return (f"{user}worker_processes 2;\ndaemon off;\npid {tmp}/nginx.pid;\n"
            f"error_log {tmp}/error.log warn;\nevents {{ worker_connections 4096; }}\n"
            f"http {{\n  access_log off;\n  client_body_temp_path {tmp}/body;\n"
            # Every temp path in the prefix: a Debian nginx defaults to /var/lib/nginx.
            f"  proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fastcgi;\n"
            f"  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;\n"
            + server(ports["prefill"], "application/json", _PREFILL_REPLY)
            + server(ports["json"], "application/json", _DECODE_REPLY)
            + server(ports["sse"], "text/event-stream", _SSE_REPLY)
            + server(ports["sse-ids"], "text/event-stream", _SSE_IDS_REPLY) + "}\n")


@contextmanager
def nginx_engines(cpus: str | None, nginx: str | None = None,
                  libs: str | None = None) -> Iterator[dict[str, int]]:
    """One nginx serving the prefill, JSON-decode and SSE-decode engines (and an SSE one
    listing token ids, `sse-ids`); their ports."""
    nginx = nginx or ensure_nginx()
    with tempfile.TemporaryDirectory(prefix="pdgate-peers-") as tmp_s:
        tmp = Path(tmp_s)
        ports = {"prefill": free_port(), "json": free_port(), "sse": free_port(),
                 "sse-ids": free_port()}
        conf = tmp / "nginx.conf"
        conf.write_text(_nginx_conf(tmp, ports))
        proc = spawn([nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")],
                     cpus, tmp / "nginx.out", tool_env(libs))
        try:
            wait_serving(ports["json"], proc, 20)
            yield ports
        finally:
            stop(proc)


# ---------------------------------------------------------------- load generation

@dataclass
class Run:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


_WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  io.write(string.format("PEERS %d %f %f %f %d\\n", summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(99) / 1e3,
    summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout))
end
"""


@dataclass(frozen=True)
class Tools:
    """Where the load generator is and how it runs (`wrk` None: the aiohttp one)."""

    wrk: str | None
    threads: int = 1
    libs: str | None = None


def _wrk(port: int, body: str, conns: int, duration: float, cpus: str | None,
         tools: Tools) -> Run:
    assert tools.wrk is not None
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_LUA.replace("{body}", body))
        script.flush()
        argv = [tools.wrk, f"-t{tools.threads}", f"-c{conns}", f"-d{max(1, round(duration))}s",
                "-s", script.name, f"http://127.0.0.1:{port}/v1/completions"]
        if cpus:
            argv = ["taskset", "-c", cpus, *argv]
        out = subprocess.run(argv, capture_output=True, text=True, check=True,
                             env=tool_env(tools.libs)).stdout
    m = re.search(r"^PEERS (\d+) ([\d.]+) ([\d.]+) ([\d.]+) (\d+)$", out, re.M)
    if not m:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return Run(int(m[1]), float(m[2]), float(m[3]), float(m[4]), int(m[5]))


async def _aiohttp_load(port: int, body: bytes, conns: int, duration: float) -> Run:
    import aiohttp

    lat: list[float] = []
    errors = 0
    url = f"http://127.0.0.1:{port}/v1/completions"
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession, stop_at: float) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session, t0 + duration) for _ in range(conns)))
        elapsed = time.perf_counter() - t0
    lat.sort()
    if not lat:
        return Run(0, elapsed, 0.0, 0.0, errors)
    return Run(len(lat), elapsed, lat[len(lat) // 2] * 1e3,
               lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3, errors)


def load(port: int, body: str, conns: int, duration: float, cpus: str | None,
         tools: Tools | None = None) -> Run:
    """One measured run: wrk when installed, else the aiohttp generator in its own process
    (so its CPU never counts as the router's and it gets its own core)."""
    tools = tools or Tools(shutil.which("wrk"))
    if tools.wrk:
        return _wrk(port, body, conns, duration, cpus, tools)
    argv = [sys.executable, __file__, "--_loadgen", json.dumps([port, body, conns, duration])]
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return Run(**json.loads(out.strip().splitlines()[-1]))


# ---------------------------------------------------------------- routers

# The policy flags of each router per case policy: pdgate's prefix-text matches the prompt's
# characters, as vllm-router's cache_aware does (pdgate's prefix-aware hashes tokens).
_POLICY_FLAGS = {
    "pdgate": {
        "round-robin": ["--prefill-policy", "round-robin", "--decode-policy", "round-robin"],
        "cache-aware": ["--prefill-policy", "prefix-text", "--decode-policy", "prefix-text"],
        # Each engine URL as 2 data-parallel ranks: every leg pinned with X-data-parallel-rank.
        "round-robin-dp2": ["--prefill-policy", "round-robin", "--decode-policy", "round-robin",
                            "--prefill-dp-size", "2", "--decode-dp-size", "2"],
        "two-models": ["--prefill-policy", "round-robin", "--decode-policy", "round-robin"],
    },
    "vllm-router": {
        "round-robin": ["--policy", "round_robin"],
        "cache-aware": ["--policy", "cache_aware"],
        "round-robin-dp2": ["--policy", "round_robin", "--intra-node-data-parallel-size", "2"],
    },
}


# The models case: two models on the same engines; its requests ask for the second.
TWO_MODELS = ("pdgate-tiny", "pdgate-tiny-b")


def pdgate_argv(port: int, p: int, d: int, workers: int, policy: str,
                args: argparse.Namespace) -> list[str]:
    # No --tokenizer: none of these policies reads tokens, so the router loads none.
    engines = {"prefill": [f"http://127.0.0.1:{p}"], "decode": [f"http://127.0.0.1:{d}"]}
    if policy == "two-models":
        models = ["--models", json.dumps([{"model": name, "max_model_len": 1000000, **engines}
                                          for name in TWO_MODELS])]
    else:
        models = ["--model", "pdgate-tiny", "--max-model-len", "1000000",
                  "--prefill", *engines["prefill"], "--decode", *engines["decode"]]
    return [sys.executable, "-m", "pdgate.router", "--port", str(port), *models,
            *_POLICY_FLAGS["pdgate"][policy],
            "--log-level", "warning", *(["--workers", str(workers)] if workers != 1 else [])]


def vllm_router_argv(port: int, p: int, d: int, workers: int, policy: str,
                     args: argparse.Namespace) -> list[str]:
    exe = shlex.split(args.vllm_router) if args.vllm_router else [str(ensure_vllm_router())]
    return [*exe, "--host", "127.0.0.1", "--port", str(port),
            "--vllm-pd-disaggregation", "--prefill", f"http://127.0.0.1:{p}",
            "--decode", f"http://127.0.0.1:{d}", *_POLICY_FLAGS["vllm-router"][policy],
            "--prometheus-port", str(free_port()), "--log-level", "warning",
            "--worker-startup-check-interval", "1"]


ROUTERS = {"pdgate": pdgate_argv, "vllm-router": vllm_router_argv}


def prompt_of(words: int) -> str:
    vocab = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while",
             "seven", "engines", "stream", "tokens", "across", "racks", "tonight")
    return " ".join(vocab[(i * 7) % len(vocab)] for i in range(words))


@dataclass(frozen=True)
class Case:
    """One group of rows: a policy, a worker count and core set, formats and sizes."""

    name: str
    policy: str
    workers: int
    cpus: str | None
    formats: tuple[str, ...]
    words: tuple[int, ...]


def cases(args: argparse.Namespace) -> list[Case]:
    """The `--cases` groups: rr, cache (sizes of 200 words and up) and workers."""
    words = tuple(args.words)
    big = tuple(w for w in words if w >= 200) or words
    out = []
    for name in args.cases.split(","):
        if name == "rr":
            out.append(Case("rr", "round-robin", 1, args.router_cpus, ("json", "sse"), words))
        elif name == "cache":
            out.append(Case("cache", "cache-aware", 1, args.router_cpus, ("json",), big))
        elif name == "dp":
            out.append(Case("dp", "round-robin-dp2", 1, args.router_cpus, ("json", "sse"),
                            words))
        elif name == "models":
            out.append(Case("models", "two-models", 1, args.router_cpus, ("json", "sse"),
                            words))
        elif name == "workers":
            out.append(Case(f"x{args.multi_workers}", "round-robin", args.multi_workers,
                            args.multi_cpus, ("json",), big))
        else:
            raise SystemExit(f"unknown case {name!r} (rr, cache, dp, workers, models)")
    return out


@dataclass
class Row:
    router: str
    case: str
    policy: str
    workers: int
    words: int
    format: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_req: float
    errors: int


def _names(args: argparse.Namespace, case: Case) -> list[str]:
    """The routers of one case, in the order each row measures them: one `pdgate@<dir>`
    per `--base-root` checkout joins the one-core round-robin case after `pdgate`."""
    names: list[str] = args.routers.split(",")
    if case.name == "models":  # vllm-router: one model per P/D router
        return [n for n in names if n == "pdgate"]
    if args.base_root and case.name == "rr" and "pdgate" in names:
        at = names.index("pdgate") + 1
        names[at:at] = [_base_name(root) for root in args.base_root]
    return names


def _base_name(root: str) -> str:
    return f"pdgate@{Path(root).name}"


def _root(args: argparse.Namespace, name: str) -> Path:
    """The checkout a pdgate row runs from."""
    for root in args.base_root or []:
        if name == _base_name(root):
            return Path(root)
    return Path(args.pdgate_root) if name == "pdgate" and args.pdgate_root else ROOT


def pdgate_env(root: Path) -> dict[str, str]:
    """The environment that imports pdgate from `root`, whatever is installed: its src/
    (or, for a checkout older than the src/ layout, the checkout itself) first on
    PYTHONPATH; the caller's PYTHONPATH (wheels on a bare machine) after it."""
    src = root / "src" if (root / "src" / "pdgate").is_dir() else root
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{src}:{old}" if old else str(src)}


def measure(args: argparse.Namespace, ports: dict[str, int], logdir: Path,
            tools: Tools) -> list[Row]:
    """Every row of every case. The routers of a case run side by side (the same cores;
    only the one under load does work), and each row measures them in turn, `--reps`
    times, each rep starting with the next router: a host whose speed drifts during the
    run, or a first-measured penalty, shifts every router alike. A row
    reports the median req/s run (and the median CPU per request of the reps)."""
    rows: list[Row] = []
    for case in cases(args):
        names = _names(args, case)
        for fmt in case.formats:
            procs: dict[str, tuple[int, subprocess.Popen[bytes], int]] = {}
            try:
                for name in names:
                    # vllm-router has no worker processes: its threads get the same cores.
                    workers = case.workers if name.startswith("pdgate") else 1
                    port = free_port()
                    kind = "pdgate" if name.startswith("pdgate") else name
                    argv = ROUTERS[kind](port, ports["prefill"], ports[fmt], workers,
                                         case.policy, args)
                    root = _root(args, name)
                    env = pdgate_env(root) if kind == "pdgate" else None
                    proc = spawn(argv, case.cpus, logdir / f"{name}-{case.name}-{fmt}.log",
                                 env=env, cwd=root)
                    procs[name] = (port, proc, workers)
                    wait_serving(port, proc, stream=fmt == "sse")
                for words in case.words:
                    runs: dict[str, list[Row]] = {name: [] for name in names}
                    for rep in range(args.reps):
                        # Each rep starts one router later: a router measured first in
                        # every rep ran ~10% slower than the same code measured later.
                        order = list(procs)[rep % len(procs):] + list(procs)[:rep % len(procs)]
                        for name in order:
                            port, proc, workers = procs[name]
                            runs[name].append(_row(args, tools, port, proc, name, case,
                                                   workers, words, fmt))
                    rows += [_median(runs[name]) for name in names]
            finally:
                for _, proc, _ in procs.values():
                    stop(proc)
    return rows


def _median(runs: list[Row]) -> Row:
    by_rps = sorted(runs, key=lambda r: r.rps)
    cpus = sorted(r.cpu_us_per_req for r in runs)
    mid = by_rps[len(runs) // 2]
    return Row(**{**asdict(mid), "cpu_us_per_req": cpus[len(cpus) // 2],
                  "errors": sum(r.errors for r in runs)})


def _row(args: argparse.Namespace, tools: Tools, port: int, proc: subprocess.Popen[bytes],
         name: str, case: Case, workers: int, words: int, fmt: str) -> Row:
    model = TWO_MODELS[1] if case.name == "models" else "pdgate-tiny"
    body = json.dumps({"model": model, "prompt": prompt_of(words),
                       "max_tokens": MAX_TOKENS, "stream": fmt == "sse"})
    load(port, body, args.connections, args.warmup, args.load_cpus, tools)
    cpu0 = cpu_seconds(proc.pid)
    run = load(port, body, args.connections, args.duration, args.load_cpus, tools)
    cpu = cpu_seconds(proc.pid) - cpu0
    print(f"  {name:<12}{case.name:<7}{words:>6} words {fmt:<5}{run.rps:>10.0f} req/s",
          file=sys.stderr)
    return Row(name, case.name, case.policy, workers, words, fmt, run.rps, run.p50_ms,
               run.p99_ms, cpu * 1e6 / max(run.requests, 1), run.errors)


_RUNTIME = ("import sys\n"
            "try:\n    import uvloop\n    loop = f'uvloop {uvloop.__version__}'\n"
            "except ImportError:\n    loop = 'asyncio (no uvloop: slower)'\n"
            "print(f'Python {sys.version.split()[0]}, event loop {loop}')")


def pdgate_runtime(args: argparse.Namespace) -> str:
    """The Python and event loop pdgate runs on (uvicorn takes uvloop when importable;
    the router's own log says so at INFO), and the machine's CPU model."""
    root = Path(args.pdgate_root) if args.pdgate_root else ROOT
    out = subprocess.run([sys.executable, "-c", _RUNTIME], capture_output=True, text=True,
                         cwd=root, env=pdgate_env(root)).stdout.strip()
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"pdgate on {out}; {os.cpu_count()} x {cpu}"


def print_table(rows: list[Row], ceiling: float, args: argparse.Namespace,
                tools: Tools) -> None:
    ref = {(r.case, r.words, r.format): r for r in rows if r.router == "vllm-router"}
    one = {(r.words, r.format): r for r in rows if r.router == "pdgate" and r.case == "rr"}
    rr = {(r.router, r.words, r.format): r for r in rows if r.case == "rr"}
    print(f"pull mode, max_tokens {MAX_TOKENS}, {args.connections} connections, "
          f"{args.duration:g} s per row; one-core cases on cpu {args.router_cpus}, "
          f"x{args.multi_workers} on cpus {args.multi_cpus}; load on cpus {args.load_cpus}")
    print(pdgate_runtime(args))
    print(f"{'router':<20}{'case':<6}{'policy':<16}{'words':>6} {'fmt':<5}{'req/s':>8}"
          f"{'p50 ms':>8}{'p99 ms':>8}{'CPU us/req':>11}{'x req/s':>8}{'x CPU':>7}"
          f"{'x 1 core':>9}{'x rr CPU':>9}{'errors':>7}")
    for r in rows:
        base = ref.get((r.case, r.words, r.format))
        rps_x = f"{r.rps / base.rps:.2f}" if base and base.rps else "-"
        cpu_x = f"{r.cpu_us_per_req / base.cpu_us_per_req:.2f}" \
            if base and base.cpu_us_per_req else "-"
        single = one.get((r.words, r.format))
        scale = f"{r.rps / single.rps:.2f}" if r.workers > 1 and single and single.rps \
            else "-"
        same = rr.get((r.router, r.words, r.format))
        vs_rr = f"{r.cpu_us_per_req / same.cpu_us_per_req:.2f}" \
            if r.case in ("dp", "models") and same and same.cpu_us_per_req else "-"
        print(f"{r.router:<20}{r.case:<6}{r.policy:<16}{r.words:>6} {r.format:<5}"
              f"{r.rps:>8.0f}{r.p50_ms:>8.2f}{r.p99_ms:>8.2f}{r.cpu_us_per_req:>11.0f}"
              f"{rps_x:>8}{cpu_x:>7}{scale:>9}{vs_rr:>9}{r.errors:>7}")
    print(f"load generator ceiling (straight to the decode nginx): {ceiling:.0f} req/s"
          f" ({'wrk' if tools.wrk else 'aiohttp'})")
    if rows and max(r.rps for r in rows) > 0.5 * ceiling:
        print("WARNING: a row is above half the load generator's ceiling: it may be "
              "loadgen-bound")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ncpu = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measured row")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--words", type=lambda s: [int(w) for w in s.split(",")],
                   default=[5, 200, 2000], help="comma-separated prompt sizes in words")
    p.add_argument("--cases",
                   default="rr,cache,models,workers" if ncpu >= 8 else "rr,cache,models",
                   help="comma-separated: rr, cache, dp, workers, models (default: rr, cache, "
                        "models and, with 8 cores or more, workers)")
    p.add_argument("--multi-workers", type=int, default=4,
                   help="pdgate --workers in the workers case")
    p.add_argument("--multi-cpus", default="0-3", help="taskset cpu list of the workers case")
    p.add_argument("--routers", default="pdgate,vllm-router",
                   help="comma-separated: pdgate, vllm-router")
    p.add_argument("--router-cpus", default="0" if ncpu > 1 else None,
                   help="taskset cpu list of the one-core cases (default: 0)")
    p.add_argument("--load-cpus",
                   default=f"4-{ncpu - 1}" if ncpu >= 8 else f"1-{ncpu - 1}" if ncpu > 1
                   else None,
                   help="taskset cpu list of nginx and the load generator (default: the "
                        "cores the routers do not use)")
    p.add_argument("--nginx", help="nginx binary (default: on PATH, else apt-get install)")
    p.add_argument("--wrk", help="wrk binary (default: on PATH, else aiohttp)")
    p.add_argument("--wrk-threads", type=int, default=2)
    p.add_argument("--tool-libs", help="directory put on LD_LIBRARY_PATH for nginx and wrk")
    p.add_argument("--pdgate-root",
                   help="run pdgate from this checkout (e.g. an older commit's git archive)")
    p.add_argument("--base-root", action="append",
                   help="also measure the pdgate of this checkout as `pdgate@<dir name>` in "
                        "the rr case, interleaved with the others (before/after in one run); "
                        "repeat it to compare several commits")
    p.add_argument("--reps", type=int, default=1,
                   help="runs per row and router, interleaved; the row is their median")
    p.add_argument("--vllm-router",
                   help="command that runs vllm-router (default: the cached venv's)")
    p.add_argument("--json", action="store_true", help="rows as JSON on the last line")
    p.add_argument("--_loadgen", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args._loadgen:  # the aiohttp load generator's own process
        port, body, conns, duration = json.loads(args._loadgen)
        print(json.dumps(asdict(asyncio.run(_aiohttp_load(port, body.encode(), conns,
                                                          duration)))))
        return
    if "vllm-router" in args.routers and not args.vllm_router:
        ensure_vllm_router()
    tools = Tools(args.wrk or shutil.which("wrk"), args.wrk_threads, args.tool_libs)
    with nginx_engines(args.load_cpus, args.nginx, args.tool_libs) as ports, \
            tempfile.TemporaryDirectory(prefix="pdgate-peers-logs-") as logs:
        body = json.dumps({"prompt": prompt_of(200), "max_tokens": MAX_TOKENS})
        ceiling = load(ports["json"], body, args.connections, args.duration / 2,
                       args.load_cpus, tools).rps
        try:
            rows = measure(args, ports, Path(logs), tools)
        except RuntimeError:
            for log in sorted(Path(logs).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
            raise
    print_table(rows, ceiling, args, tools)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "loadgen_ceiling_rps": ceiling,
                          "connections": args.connections, "runtime": pdgate_runtime(args)}))


if __name__ == "__main__":
    main()
