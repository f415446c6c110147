"""`pdgate shim` / `python -m pdgate.engine_shim`: one engine process (model, paged KV, NIXL, HTTP).

`build_parser()` declares every flag (docs/cli.md is generated from it);
`main(argv)` loads the model, wires the KV connector and serves with uvicorn until SIGINT or
SIGTERM, then shuts down gracefully (in-flight requests get `--graceful-shutdown-timeout`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

from pdgate.common.tracing import TracingUnavailable
from pdgate.engine_shim import credentials
from pdgate.engine_shim.body_limit import DEFAULT_MAX_BODY_BYTES
from pdgate.engine_shim.engine import Engine, EngineConfig
from pdgate.engine_shim.kv_layout import LAYOUTS
from pdgate.engine_shim.logs import LOG_FORMATS, RequestIdMiddleware, setup_logging
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.server import ConnectorFactory, ManagedConnector, ServerSettings, create_app
from pdgate.engine_shim.tracing import open_tracing, traced
from pdgate.engine_shim.warmup import default_warmup_tokens

log = logging.getLogger("pdgate.engine_shim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdgate shim",
        description="Engine shim: an OpenAI-compatible Llama engine with a paged KV cache that "
        "speaks vLLM's NixlConnector kv_transfer_params protocol (prefill and decode roles).",
    )
    p.add_argument("--model", default="tiny",
                   help="'tiny' (built-in random-weight model) or a local HF Llama directory")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: pdgate-tiny, or the --model path)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8100, help="HTTP listen port")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--cpus", type=_cpu_list, default=None, metavar="LIST",
                   help="run on these CPU cores only, e.g. 0 or 2-3,6 (torch's threads: "
                        "one per core): engines sharing a machine then do not compete "
                        "for its cores (default: every core)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="model and KV dtype (default: float32 on cpu, the checkpoint's on cuda)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks in the pool")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens (default: the model's limit, "
                   "capped at num-blocks x block-size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="tokens one step may compute (vLLM's flag): every decode, then "
                   "prompts first come first served while it lasts, at least one (prompts "
                   "are not chunked); default 0: every waiting prompt in each step")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="run one prompt this long at startup, before /health answers, so "
                   "the first request does not pay the GPU's first use (as vLLM warms up); "
                   "default 1024 on CUDA, 0 (none) on CPU")
    p.add_argument("--engine-id", default=None,
                   help="NIXL engine id announced to peers (default: a random uuid)")
    p.add_argument("--side-channel-host", default="127.0.0.1",
                   help="address of the NIXL metadata side channel (sent to decode engines)")
    p.add_argument("--side-channel-port", type=int, default=5600,
                   help="port of the NIXL metadata side channel (vLLM's default is 5600; "
                   "0 binds a free port)")
    p.add_argument("--admission-timeout", type=float, default=60.0,
                   help="seconds a request may wait (first come, first served) for free KV "
                   "blocks before it is refused with a 503")
    p.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="how long a prefill engine pins blocks for a decode engine that has "
                   "not read them yet")
    p.add_argument("--kv-reserve-seconds", type=float, default=60.0,
                   help="notify mode: how long a decode engine keeps blocks reserved for a "
                   "prefill engine's write before freeing them unclaimed")
    p.add_argument("--notify-secret", default=None, metavar="SECRET",
                   help="shared secret signing KV-ready notifications to the router "
                   "(same as the router's --notify-secret; or env "
                   f"{credentials.NOTIFY_SECRET_ENV}, or a file named by "
                   f"{credentials.NOTIFY_SECRET_ENV}_FILE)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="Bearer key every request must send (Authorization: Bearer KEY), "
                   "except GET /health and, unless --protect-metrics, GET /metrics; at least "
                   f"{credentials.MIN_API_KEY_CHARS} characters (or env "
                   f"{credentials.API_KEY_ENV}, or a file named by "
                   f"{credentials.API_KEY_ENV}_FILE; the same key as the router's "
                   "--engine-api-key). Required on a non-loopback --host unless "
                   "--allow-unauthenticated is given")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve on a non-loopback --host without an API key: every route, "
                   "the internal /v1/kv/* and /debug/* ones included, is open to whoever "
                   "reaches the port (logged at start and reported by GET /health)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="GET /metrics needs the API key too (default: open for Prometheus)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="N",
                   help="largest request body accepted; a bigger one gets a 413 before it "
                   "is read (by its Content-Length) or as soon as a chunked body crosses it")
    p.add_argument("--no-kv-transfer", action="store_true",
                   help="start without the NIXL connector (colocated serving only; decode "
                   "requests recompute the prompt)")
    p.add_argument("--kv-buffer-device", choices=["cpu", "cuda"], default=None,
                   help="where the buffer NIXL registers lives (vLLM's kv_buffer_device): "
                   "default the KV cache itself; 'cpu' registers a host (pinned on CUDA) "
                   "staging buffer and copies the transferred blocks device <-> host, for "
                   "devices or transports that cannot move device memory")
    p.add_argument("--kv-layout", choices=sorted(LAYOUTS), default="block",
                   help="KV cache memory layout: 'block' = [blocks, layers, K|V, ...] (a run "
                   "of consecutive blocks is one NIXL descriptor), 'layer' = [layers, K|V, "
                   "blocks, ...] (one descriptor per layer and K|V). P and D must agree")
    p.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"],
                   default="recompute",
                   help="a decode whose remote KV cannot be loaded (failed READ, missing "
                   "push or notice): 'recompute' the prompt here, or 'fail' it with a 502")
    p.add_argument("--kv-digests", action="store_true",
                   help="hash handed-over and pulled KV blocks into GET /debug/kv_transfers "
                   "(tests: D's bytes equal P's; costs a copy of the blocks per request)")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the sampling of requests that bring no seed, so a run is "
                   "reproducible (default: fresh randomness per request)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="keep full prompt blocks after a request and reuse them for later "
                   "prompts with the same prefix (reported as cached_tokens)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="bind a ZMQ PUB socket here and publish KV cache events in vLLM's "
                   "format, e.g. tcp://0.0.0.0:5557 (for kv-events routing; default: off)")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="topic frame of published KV cache events")
    p.add_argument("--graceful-shutdown-timeout", type=int, default=10,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"], help="log level")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="log lines as text or one JSON object each")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="OpenTelemetry: OTLP/HTTP URL spans are sent to (default: off, unless "
                   "OTEL_EXPORTER_OTLP_*ENDPOINT is set; needs the otel extra)")
    _add_kv_timing(p)
    return p


def _add_kv_timing(p: argparse.ArgumentParser) -> None:
    """The KV path's deadlines and graces (seconds). Defaults are the values they had
    when they were constants; --kv-lease-seconds and --kv-reserve-seconds are above."""
    g = p.add_argument_group("KV transfer deadlines (seconds)")
    g.add_argument("--kv-transfer-timeout", type=_positive_float, default=30.0, metavar="S",
                   help="seconds for one NIXL READ or WRITE; also how long a push-mode "
                   "decode waits for the prefill engine's WRITE after registering (a decode "
                   "leg's push_deadline may end it sooner; a prefill engine that will not "
                   "write says so at once)")
    g.add_argument("--kv-handshake-timeout", type=_positive_float, default=5.0, metavar="S",
                   help="seconds for one side-channel handshake with a peer engine")
    g.add_argument("--kv-landing-timeout", type=_positive_float, default=10.0, metavar="S",
                   help="notify mode: seconds a decode leg waits for the prefill engine's "
                   "landed notice (it trails the router's KV-ready by ~ms)")
    g.add_argument("--kv-push-grace-seconds", type=_non_negative_float, default=2.0,
                   metavar="S",
                   help="push mode: seconds the blocks of a cancelled decode stay out of the "
                   "pool (the prefill engine may be writing into them)")
    g.add_argument("--kv-abort-grace-seconds", type=_non_negative_float, default=2.0,
                   metavar="S",
                   help="notify mode: seconds POST /v1/kv/abort keeps a reservation's blocks "
                   "out of the pool when a WRITE into them may still land")
    g.add_argument("--kv-probe-timeout", type=_positive_float, default=10.0, metavar="S",
                   help="seconds the start-up KV transport probe (GPU KV only) may take, "
                   "delaying serving, on a broken transport")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


@dataclass(frozen=True)
class ConnectorSettings:
    """Arguments of `engine_shim.connector.KVConnector` that come from the command line."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    lease_seconds: float
    notify_secret: str | None = None
    transfer_timeout: float = 30.0
    handshake_timeout: float = 5.0
    probe_timeout: float = 10.0


def nixl_connector_factory(settings: ConnectorSettings) -> ConnectorFactory:
    """A factory the server's lifespan calls with the loaded engine. The NIXL import happens
    only then, so `--help` and colocated tests do not load nixl."""

    def build(engine: Engine) -> ManagedConnector:
        from pdgate.engine_shim.connector import KVConnector
        from pdgate.engine_shim.nixl_agent import nixl_agent_factory

        connector: ManagedConnector = KVConnector(
            engine_id=settings.engine_id,
            model_name=engine.served_model_names[0],
            kv=engine.transfer_memory,  # host staging mirror with --kv-buffer-device cpu
            side_channel_host=settings.side_channel_host,
            side_channel_port=settings.side_channel_port,
            lease_seconds=settings.lease_seconds,
            free_blocks=engine.free_blocks,
            metrics=engine.metrics,
            notify_secret=settings.notify_secret,
            transfer_timeout=settings.transfer_timeout,
            handshake_timeout=settings.handshake_timeout,
            probe_timeout=settings.probe_timeout,
            agent_factory=nixl_agent_factory,
            starved_need=engine.scheduler.starved_need,
        )
        return connector

    return build


def _cpu_list(text: str) -> set[int]:
    """`0`, `2-3,6`: a set of core numbers (argparse type)."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}") from None
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}")
    return cores


def confine(cores: set[int]) -> None:
    """Run this process on `cores` only: every thread it has now (the kernel's affinity is
    per thread; threads started later inherit it), and torch's intra-op threads, one per
    core."""
    import torch

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    torch.set_num_threads(len(cores))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        seed=args.seed,
        kv_digests=args.kv_digests,
        admission_timeout=args.admission_timeout,
        prefix_caching=args.enable_prefix_caching,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        reserve_seconds=args.kv_reserve_seconds,
        kv_buffer_device=args.kv_buffer_device,
        kv_layout=LAYOUTS[args.kv_layout],
        kv_load_failure_policy=args.kv_load_failure_policy,
        landing_timeout=args.kv_landing_timeout,
        push_grace=args.kv_push_grace_seconds,
        reservation_abort_grace=args.kv_abort_grace_seconds,
        max_num_batched_tokens=args.max_num_batched_tokens,
        warmup_tokens=default_warmup_tokens(args.device) if args.warmup_tokens is None
        else max(0, args.warmup_tokens),
    )


def secured_settings(args: argparse.Namespace,
                     environ: Mapping[str, str]) -> tuple[ServerSettings, str | None]:
    """The HTTP edge and the notify secret, from the flags or else `environ` (see
    `credentials`). Raises CredentialError when a secret cannot be used."""
    edge = ServerSettings(api_key=credentials.api_key(args.api_key, environ),
                          protect_metrics=args.protect_metrics,
                          max_body_bytes=args.max_body_bytes)
    if edge.protect_metrics and edge.api_key is None:
        raise credentials.CredentialError(
            f"--protect-metrics needs an API key (--api-key or {credentials.API_KEY_ENV})")
    if edge.api_key is None and not is_loopback(args.host) and not args.allow_unauthenticated:
        raise credentials.CredentialError(
            f"refusing to serve on {args.host} without an API key: anyone reaching the port "
            "could take every KV block or free another request's. Set --api-key, "
            f"{credentials.API_KEY_ENV} or {credentials.API_KEY_ENV}_FILE (the router's "
            "--engine-api-key), or pass --allow-unauthenticated to serve open on purpose")
    return edge, credentials.notify_secret(args.notify_secret, environ)


def is_loopback(host: str) -> bool:
    """True when `host` binds loopback only (`localhost`, 127.0.0.0/8, ::1). Any other name
    may resolve to a reachable address, so it counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        edge, notify_secret = secured_settings(args, os.environ)
    except credentials.CredentialError as e:
        parser.error(str(e))
    setup_logging(args.log_level, args.log_format)
    if args.cpus is not None:
        try:
            confine(args.cpus)
        except OSError as e:  # a core this machine does not have
            parser.error(f"--cpus: {e}")
    engine_id = args.engine_id or f"shim-{uuid.uuid4().hex[:12]}"
    try:
        tracing = open_tracing(args.otlp_traces_endpoint, engine_id, os.environ)
    except TracingUnavailable as e:
        parser.error(str(e))
    try:
        engine = Engine.load(engine_config(args), ShimMetrics.create())
    except (ValueError, OSError) as e:
        log.error("cannot load the model: %s", e)
        return 1
    factory = None
    if not args.no_kv_transfer:
        factory = nixl_connector_factory(ConnectorSettings(
            engine_id=engine_id,
            side_channel_host=args.side_channel_host,
            side_channel_port=args.side_channel_port,
            lease_seconds=args.kv_lease_seconds,
            notify_secret=notify_secret,
            transfer_timeout=args.kv_transfer_timeout,
            handshake_timeout=args.kv_handshake_timeout,
            probe_timeout=args.kv_probe_timeout,
        ))
    if edge.api_key is None and not is_loopback(args.host):
        log.warning("--allow-unauthenticated: serving UNAUTHENTICATED on %s; every route is "
                    "open to whoever reaches port %d", args.host, args.port)
    kv = engine.kv
    log.info("serving %s (max_model_len %d, %d blocks of %d) on http://%s:%d; model on %s, "
             "KV cache %.1f MiB in %s", engine.served_model_names[0], engine.max_model_len,
             args.num_blocks, args.block_size, args.host, args.port, kv.device, kv.nbytes / 2**20,
             kv.mem_type)
    import uvicorn

    config = uvicorn.Config(
        RequestIdMiddleware(traced(create_app(engine, connector_factory=factory,
                                              settings=edge), tracing)),
        host=args.host, port=args.port,
        loop="uvloop", http="httptools", log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout, access_log=False,
        log_config=None,
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the
    # previous handlers restored; these turn that into a clean exit status 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass
    finally:
        if tracing is not None:
            tracing.shutdown()  # export what is still buffered
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
