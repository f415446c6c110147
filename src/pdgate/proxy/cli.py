"""Standalone proxy: ``python -m pdgate.proxy --bind tcp://0.0.0.0:7500 ...``.

Useful for tests, benchmarks and to watch what engines send; in production the router runs
the same `NotifyServer` inside its own process. The bound endpoint is printed on stdout as
``listening <endpoint>`` once the socket is up. Stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from prometheus_client import start_http_server

from pdgate.proxy.config import ProxyConfig
from pdgate.proxy.metrics import ProxyMetrics
from pdgate.proxy.server import NotifyServer

SECRET_ENV = "PDGATE_NOTIFY_SECRET"


def build_parser() -> argparse.ArgumentParser:
    """The standalone proxy's argument parser (also used to render the CLI docs)."""
    d = ProxyConfig()
    p = argparse.ArgumentParser(
        prog="python -m pdgate.proxy", description="pdgate KV-ready notification proxy (ZMQ PULL).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--bind", default=d.bind,
                   help="zmq endpoint to bind; port 0 picks a free port (printed on stdout)")
    p.add_argument("--advertise-host", default=None,
                   help="host engines connect to when --bind uses a wildcard host")
    p.add_argument("--notify-secret", default=os.environ.get(SECRET_ENV),
                   help=f"shared HMAC-SHA256 secret (>= 16 chars); frames without a valid MAC "
                        f"are dropped. Prefer the {SECRET_ENV} environment variable: "
                        "arguments are visible in the process list")
    p.add_argument("--ttl-seconds", type=float, default=d.ttl_s,
                   help="lifetime of unclaimed early arrivals and never-awaited waiters")
    p.add_argument("--reap-interval", type=float, default=d.reap_interval_s,
                   help="seconds between reaper passes")
    p.add_argument("--max-early", type=int, default=d.max_early,
                   help="most early arrivals held; the oldest is evicted beyond")
    p.add_argument("--max-early-bytes", type=int, default=d.max_early_bytes,
                   help="most payload bytes of early arrivals held; the oldest evicted beyond")
    p.add_argument("--max-waiters", type=int, default=d.max_waiters,
                   help="most waiters registered at once")
    p.add_argument("--rcv-hwm", type=int, default=d.rcv_hwm,
                   help="zmq receive high-water mark (messages queued per connected peer)")
    p.add_argument("--max-msg-bytes", type=int, default=d.max_msg_bytes,
                   help="largest frame accepted; a peer sending more is disconnected")
    p.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes,
                   help="largest notification payload decoded; bigger ones are dropped and "
                        "counted (result too_large) before any HMAC or parsing")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics over HTTP on this port (0: off)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    return p


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Build and validate the config; raises ValueError naming the bad setting."""
    return ProxyConfig(
        bind=args.bind, advertise_host=args.advertise_host, notify_secret=args.notify_secret,
        ttl_s=args.ttl_seconds, reap_interval_s=args.reap_interval, max_early=args.max_early,
        max_early_bytes=args.max_early_bytes, max_waiters=args.max_waiters,
        rcv_hwm=args.rcv_hwm, max_msg_bytes=args.max_msg_bytes,
        max_frame_bytes=args.max_frame_bytes,
    ).validate()


async def serve(config: ProxyConfig, metrics: ProxyMetrics) -> None:
    """Run a `NotifyServer` until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with NotifyServer(config, metrics=metrics) as server:
        print(f"listening {server.advertised_endpoint}", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pdgate.proxy``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    metrics = ProxyMetrics.create()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="127.0.0.1", registry=metrics.registry)
    asyncio.run(serve(config, metrics))
    return 0
