"""`pdgate up`: a local xPyD cluster of shim engines and a router, in the foreground.

Children run in their own sessions so a Ctrl-C in the terminal reaches only this process,
which then stops them in order (router first, so no request is routed to a dying engine)
and waits for every PID it started. Their logs go to files so the console stays readable.

Secure by default: the cluster gets an engine key of its own (generated, or
`--engine-api-key`), which every engine requires and the router sends on its legs; it is
written to `<log dir>/engine-api-key` (mode 0600) for whoever needs to reach an engine
directly. `--api-key` makes the router require a client key too. Keys reach the children
in their environment (PDGATE_ENGINE_API_KEY, PDGATE_API_KEY), never on a command line.
`--allow-unauthenticated` starts the engines without a key (tests that call them directly).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdgate.up_checks import is_tiny, refusal
from pdgate.up_models import ModelPlan, plan_models, write_router_config

DEMO_PROMPT = "The quick brown fox"
RANDOM_WEIGHTS_NOTE = ("note            : the built-in tiny model has random weights, so this "
                       "text is gibberish by design;\n                  what the demo shows is "
                       "the P/D path: the engines used and the KV bytes moved")


@dataclass
class Child:
    """One process this command started, with where its output goes."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Cluster:
    """The processes of one `pdgate up`; `stop()` ends all of them."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, url: str, argv: list[str],
              env: dict[str, str] | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )
        child = Child(name, url, proc, log)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 10.0) -> None:
        # Router first: it stops taking requests before the engines go away.
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            _wait_or_kill(child.proc, grace_s)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)


def _wait_or_kill(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdgate up",
        description="Start a local P/D cluster (shim engines + router) in the foreground.",
    )
    p.add_argument("--prefill", type=int, default=1,
                   help="number of prefill engines (of each model)")
    p.add_argument("--decode", type=int, default=1, help="number of decode engines (of each "
                   "model)")
    p.add_argument("--models", type=int, default=1,
                   help="models behind the router: model i > 0 is the tiny model with "
                   "another seed (other weights), served as <name>-<i+1>, with engines of its "
                   "own")
    p.add_argument("--colocated-models", type=int, default=0, metavar="N",
                   help="the last N models run colocated: decode engines only")
    p.add_argument(
        "--model", default="tiny",
        help="'tiny' (built-in random-weight model) or a local HF model directory",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every process binds")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument(
        "--engine-port-base", type=int, default=8100,
        help="first engine HTTP port; engine i uses base+i",
    )
    p.add_argument(
        "--side-channel-port-base", type=int, default=5600,
        help="first NIXL side-channel port; engine i uses base+i",
    )
    p.add_argument("--device", default="cpu",
                   help="engine device: cpu, cuda or cuda:N; a comma list (cuda:0,cuda:1,...) "
                   "gives the engines its devices in turn, in start order (each model's "
                   "prefill engines, then its decode engines)")
    p.add_argument("--cores-per-engine", type=int, default=0, metavar="N",
                   help="engine i runs on cores i*N..i*N+N-1 only, in start order (its "
                   "--cpus), as engines on GPUs of their own do not compete; the router "
                   "keeps this command's cores (default 0: engines share every core)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: float32 on cpu)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per engine")
    p.add_argument(
        "--pd-mode", choices=["pull", "notify", "push"], default="pull",
        help="P/D flow (pull: vLLM NixlConnector, decode engine READs prefill's KV; notify: "
        "prefill WRITEs into blocks reserved on decode and tells the router; push: both legs "
        "at once, decode registers its blocks with prefill)",
    )
    p.add_argument("--notify-secret", default=None,
                   help="shared secret signing KV-ready notices (router and engines)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="client key the router requires on /v1/* (Authorization: Bearer "
                   "KEY; at least 8 characters); default: the router serves anyone")
    p.add_argument("--engine-api-key", default=None, metavar="KEY",
                   help="the cluster's engine key (engines require it, the router sends it; "
                   "at least 8 characters); default: a generated one, written to "
                   "<log dir>/engine-api-key")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="start the engines without an engine key: anyone who reaches their "
                   "ports may use them, the internal /v1/kv/* and /debug/* routes included")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for the router, e.g. --router-arg=--kv-ready-timeout-s=5 "
                   "(repeatable)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every engine, e.g. --engine-arg=--kv-lease-seconds=5 "
                   "(repeatable)")
    p.add_argument("--prefill-engine-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for prefill engines only (after --engine-arg, so it wins), "
                   "e.g. --prefill-engine-arg=--block-size=32 (repeatable)")
    p.add_argument("--decode-engine-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for decode engines only, e.g. "
                   "--decode-engine-arg=--kv-buffer-device=cpu (repeatable)")
    p.add_argument("--prefill-policy", default="round-robin", help="prefill-leg policy")
    p.add_argument("--decode-policy", default="round-robin", help="decode-leg policy")
    p.add_argument(
        "--kv-digests", action="store_true",
        help="engines record a digest of every KV transfer (GET /debug/kv_transfers)",
    )
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a temp dir)")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="log format of the router and the engines (their --log-format)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="OpenTelemetry OTLP traces endpoint for the router and the engines "
                   "(OTLP/HTTP: the .../v1/traces URL; with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
                   "=grpc: http://host:4317)")
    p.add_argument(
        "--startup-timeout", type=float, default=180.0,
        help="seconds to wait for every process to become ready",
    )
    p.add_argument("--no-demo", action="store_true", help="skip the sample request")
    p.add_argument(
        "--exit-after-demo", action="store_true",
        help="stop the cluster after the sample request (exit code says if it worked)",
    )
    return p


def _engine_argv(args: argparse.Namespace, plan: ModelPlan, name: str, i: int) -> list[str]:
    argv = [
        sys.executable, "-m", "pdgate.engine_shim",
        "--model", plan.model_dir, "--served-model-name", plan.name,
        "--host", args.host, "--port", str(args.engine_port_base + i),
        "--device", engine_device(args.device, i), "--block-size", str(args.block_size),
        "--num-blocks", str(args.num_blocks), "--engine-id", name,
        "--side-channel-host", args.host,
        "--side-channel-port", str(args.side_channel_port_base + i),
    ]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.kv_digests:
        argv.append("--kv-digests")
    argv += ["--log-format", args.log_format]
    if args.cores_per_engine > 0:  # before the extra flags: an explicit --cpus wins
        first = i * args.cores_per_engine
        argv += ["--cpus", f"{first}-{first + args.cores_per_engine - 1}"]
    if args.otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.notify_secret:
        argv += ["--notify-secret", args.notify_secret]
    if args.allow_unauthenticated and not _loopback(args.host):
        argv.append("--allow-unauthenticated")
    extra: list[str] = args.engine_arg
    role_extra: list[str] = (args.prefill_engine_arg if _is_prefill(name)
                             else args.decode_engine_arg)
    return argv + extra + role_extra


def engine_device(spec: str, i: int) -> str:
    """The device of the `i`-th engine started: `spec` is one device or a comma list taken
    in turn (one engine per GPU on a multi-GPU host, as each pool would have in production)."""
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    return devices[i % len(devices)]


def _is_prefill(name: str) -> bool:
    return "prefill" in name.split("-")


def _router_argv(args: argparse.Namespace, plans: list[ModelPlan],
                 engines: list[list[Child]], log_dir: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "pdgate.router", "--host", args.host, "--port", str(args.port),
        "--prefill-policy", args.prefill_policy, "--decode-policy", args.decode_policy,
        "--pd-mode", args.pd_mode, "--log-format", args.log_format,
    ]
    if args.otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.notify_secret:
        argv += ["--notify-secret", args.notify_secret]
    if len(plans) > 1 or plans[0].colocated:  # several models: a models: config
        urls = [([c.url for c in mine if _is_prefill(c.name)],
                 [c.url for c in mine if not _is_prefill(c.name)]) for mine in engines]
        return argv + ["--config", str(write_router_config(
            log_dir / "router-models.yaml", plans, urls)), *args.router_arg]
    argv += ["--model", plans[0].model_dir, "--served-model-name", plans[0].name]
    for child in engines[0]:
        argv += ["--prefill" if _is_prefill(child.name) else "--decode", child.url]
    # Last: a --router-arg adds to the lists above (another served name is an alias; the
    # first one stays the name the engines serve) and overrides single values.
    extra: list[str] = args.router_arg
    return argv + extra


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def cluster_keys(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """(engine env, router env): the keys each child gets in its environment. The engine
    key is `--engine-api-key` or generated (none with `--allow-unauthenticated`)."""
    engine: dict[str, str] = {}
    router: dict[str, str] = {}
    if not args.allow_unauthenticated:
        key = args.engine_api_key or secrets.token_urlsafe(32)
        engine["PDGATE_ENGINE_API_KEY"] = router["PDGATE_ENGINE_API_KEY"] = key
    if args.api_key:
        router["PDGATE_API_KEY"] = args.api_key
    return engine, router


def _write_engine_key(log_dir: Path, engine_env: dict[str, str]) -> Path | None:
    key = engine_env.get("PDGATE_ENGINE_API_KEY")
    if key is None:
        return None
    path = log_dir / "engine-api-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return path


def _served_name(args: argparse.Namespace) -> str:
    if args.model == "tiny":
        from pdgate.engine_shim.tiny import TINY_MODEL_NAME

        return TINY_MODEL_NAME
    return Path(args.model).name


def _resolve_model(args: argparse.Namespace) -> str:
    if args.model != "tiny":
        return str(Path(args.model).resolve())
    # Built once here so the engines and the router do not race to build it.
    from pdgate.engine_shim.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def _http_json(url: str, body: dict[str, object] | None = None, timeout: float = 5.0,
               key: str | None = None) -> tuple[int, dict[str, object], dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}"), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), dict(err.headers)


def _wait_ready(cluster: Cluster, child: Child, path: str, deadline: float,
                engines: int = 0) -> None:
    """Until `child` answers `path` with 200 (and, `engines` > 0, the router's /ready counts
    that many healthy engines: it is ready with one pair, but a cluster is up when the
    router sees all of it, or a benchmark's first seconds run on part of it)."""
    while time.monotonic() < deadline:
        dead = cluster.dead_child()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited with {dead.proc.returncode}; see {dead.log}")
        try:
            status, body, _ = _http_json(child.url + path, timeout=1.0)
            healthy = sum(v for k in ("prefill_healthy", "decode_healthy")
                          if isinstance(v := body.get(k), int))
            if status == 200 and healthy >= engines:
                return
        # HTTPException: before the child listens, a connect to its port can land on the
        # client's own socket (TCP self-connect) and read its own request back.
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{child.name} not ready after the startup timeout; see {child.log}")


def _kv_read_bytes(url: str) -> float:
    """Sum of the engine's NIXL READ and WRITE bytes counters, from its Prometheus text."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2.0) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pdgate_shim_kv_transfer_bytes_total") and (
                'op="read"' in line or 'op="write"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_demo(args: argparse.Namespace, router_url: str, plan: ModelPlan,
             engines: list[Child]) -> bool:
    """Send one completion through `plan`'s model (the P/D path unless it is colocated)
    and print what happened."""
    decoders = engines  # pull: D READs; notify/push: P WRITEs
    before = sum(_kv_read_bytes(c.url) for c in decoders)
    body = {"model": plan.name, "prompt": DEMO_PROMPT, "max_tokens": 16, "temperature": 0}
    status, reply, headers = _http_json(router_url + "/v1/completions", body, timeout=60.0,
                                        key=args.api_key)
    moved = sum(_kv_read_bytes(c.url) for c in decoders) - before
    if status != 200:
        print(f"sample request failed: HTTP {status}: {reply}", flush=True)
        return False
    choices = reply.get("choices") or [{}]
    text = choices[0].get("text", "") if isinstance(choices, list) else ""
    print(f"\nmodel           : {plan.name}\nsample request  : {DEMO_PROMPT!r}\n"
          f"answer          : {text!r}")
    if args.model == "tiny" or is_tiny(Path(args.model)):
        print(RANDOM_WEIGHTS_NOTE)
    print(f"prefill engine  : {headers.get('x-pdgate-prefill-engine', '-')}")
    print(f"decode engine   : {headers.get('x-pdgate-decode-engine', '?')}")
    if plan.colocated:
        print("KV bytes moved  : none (colocated: the decode engine computed the prompt)")
    else:
        how = "READ" if args.pd_mode == "pull" else "WRITE"
        print(f"KV bytes moved  : {int(moved)} (NIXL {how}, decode <- prefill, {args.pd_mode})")
    print(f"usage           : {reply.get('usage')}", flush=True)
    return plan.colocated or moved > 0


def _print_curl(args: argparse.Namespace, router_url: str, plans: list[ModelPlan]) -> None:
    body = json.dumps({"model": plans[-1].name, "prompt": "Hello", "max_tokens": 16})
    if len(plans) > 1:
        print(f"\nmodels          : {', '.join(p.name for p in plans)} (GET /v1/models)")
    auth = " -H 'Authorization: Bearer <your --api-key>'" if args.api_key else ""
    print(
        f"\nrouter serving on {router_url}; try:\n"
        f"  curl -s {router_url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'\nCtrl-C stops the cluster.",
        flush=True,
    )


def start_cluster(args: argparse.Namespace, cluster: Cluster) -> tuple[str, list[ModelPlan],
                                                                     list[list[Child]]]:
    """Start every model's engines, then the router; return the router's URL, the models
    and each model's engine children."""
    plans = plan_models(args.models, args.colocated_models, _resolve_model(args),
                        _served_name(args), args.prefill, args.decode)
    engine_env, router_env = cluster_keys(args)
    key_file = _write_engine_key(cluster.log_dir, engine_env)
    if key_file is not None:
        print(f"engine key      : {key_file} (engines serve only the router)", flush=True)
    engines: list[list[Child]] = []
    i = 0
    for m, plan in enumerate(plans):
        mine = []
        prefix = f"m{m}-" if len(plans) > 1 else ""
        roles = [("prefill", n) for n in range(plan.prefill)] + [
            ("decode", n) for n in range(plan.decode)]
        for role, n in roles:
            name, url = f"{prefix}{role}-{n}", f"http://{args.host}:{args.engine_port_base + i}"
            mine.append(cluster.spawn(name, url, _engine_argv(args, plan, name, i), engine_env))
            i += 1
        engines.append(mine)
    router_url = f"http://{args.host}:{args.port}"
    router = cluster.spawn("router", router_url,
                           _router_argv(args, plans, engines, cluster.log_dir), router_env)
    deadline = time.monotonic() + args.startup_timeout
    for child in (c for mine in engines for c in mine):
        _wait_ready(cluster, child, "/health", deadline)
    _wait_ready(cluster, router, "/ready", deadline, sum(len(mine) for mine in engines))
    return router_url, plans, engines


def _serve_forever(cluster: Cluster) -> int:
    while True:
        dead = cluster.dead_child()
        if dead is not None:
            print(f"{dead.name} exited ({dead.proc.returncode}); see {dead.log}", flush=True)
            return 1
        time.sleep(0.5)


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refused = refusal(args)
    if refused is not None:
        print(f"pdgate up: {refused}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdgate-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(log_dir)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    each = f" x {args.models} models" if args.models > 1 else ""
    print(f"pdgate up: {args.prefill}P{args.decode}D{each}, logs in {log_dir}", flush=True)
    try:
        router_url, plans, engines = start_cluster(args, cluster)
        ok = args.no_demo or all([run_demo(args, router_url, plan, mine)
                                  for plan, mine in zip(plans, engines, strict=True)])
        if args.exit_after_demo:
            return 0 if ok else 1
        _print_curl(args, router_url, plans)
        return _serve_forever(cluster)
    except _Stop:
        return 0
    except RuntimeError as err:
        print(f"pdgate up: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping cluster...", flush=True)
        cluster.stop()
