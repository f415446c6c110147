"""Command line for the router: `python -m router` and `pdgate router`.

Every flag sets the `RouterConfig` field of the same name (dashes for underscores) and
overrides the `--config` YAML file, which in turn overrides the defaults.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from router.config import ConfigError, RouterConfig, load_config

__all__ = ["build_parser", "main"]

_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(RouterConfig)}

_METAVARS = {
    "model": "PATH_OR_NAME", "tokenizer": "PATH_OR_NAME", "prefill": "URL", "decode": "URL",
    "served_model_name": "NAME", "pd_mode": "MODE", "prefill_policy": "POLICY",
    "decode_policy": "POLICY", "host": "ADDR", "log_level": "LEVEL",
}

# (field, type, help). Lists are repeatable flags; the default is appended to the help.
_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("model", str, "model directory or hub name: tokenizer source and default served name"),
    ("prefill", list, "prefill engine base URL, e.g. http://10.0.0.1:8100 (repeatable)"),
    ("decode", list, "decode engine base URL, e.g. http://10.0.0.2:8200 (repeatable)"),
    ("served_model_name", list, "model name clients may request (repeatable; "
                                "default: --model)"),
    ("tokenizer", str, "tokenizer directory or hub name (default: --model)"),
    ("max_model_len", int, "context length in tokens (default: from the model's "
                           "config.json or the tokenizer)"),
    ("pd_mode", str, "disaggregation flow; only 'pull' (vLLM NixlConnector) for now"),
    ("prefill_policy", str, "how to pick a prefill engine: round-robin | least-inflight"),
    ("decode_policy", str, "how to pick a decode engine: round-robin | least-inflight"),
    ("host", str, "address to listen on"),
    ("port", int, "port to listen on"),
    ("connect_timeout_s", float, "seconds to open a TCP connection to an engine"),
    ("prefill_timeout_s", float, "seconds for the whole prefill leg"),
    ("decode_first_byte_timeout_s", float, "seconds until a decode engine answers"),
    ("decode_idle_timeout_s", float, "max seconds between two chunks of a decode reply"),
    ("health_interval_s", float, "seconds between engine health checks (GET /health)"),
    ("health_timeout_s", float, "seconds one health check may take"),
    ("max_connections", int, "max pooled connections to all engines together"),
    ("engine_keepalive_s", float, "seconds an idle engine connection is kept open"),
    ("max_body_bytes", int, "largest accepted request body in bytes (larger: 413)"),
    ("shutdown_timeout_s", float, "seconds to let in-flight requests finish on shutdown"),
    ("log_level", str, "critical | error | warning | info | debug"),
)


def build_parser() -> argparse.ArgumentParser:
    """The router's argument parser. Unset flags are absent from the namespace, so they
    do not override values from `--config`."""
    parser = argparse.ArgumentParser(
        prog="pdgate router",
        description="OpenAI-compatible prefill/decode disaggregating router.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="YAML",
                        help="YAML file with RouterConfig fields (flags override it)")
    for field, typ, text in _FLAGS:
        flag = "--" + field.replace("_", "-")
        default = _DEFAULTS.get(field, msgspec.NODEFAULT)
        if default not in (msgspec.NODEFAULT, None, []):
            text = f"{text} (default: {default})"
        metavar = _METAVARS.get(field, "N" if typ is int else "SECONDS")
        if typ is list:
            parser.add_argument(flag, action="append", metavar=metavar, help=text)
        else:
            parser.add_argument(flag, type=typ, metavar=metavar, help=text)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse `argv` into a `RouterConfig` (YAML file, then flags). Raises `ConfigError`."""
    args = vars(build_parser().parse_args(argv))
    yaml_path = args.pop("config", None)
    return load_config(yaml_path, args)


def main(argv: list[str] | None = None) -> int:
    """Run the router until SIGINT/SIGTERM. Returns the process exit status."""
    try:
        config = config_from_args(argv)
        from router.app import create_app  # after parsing: --help stays fast

        app = create_app(config)
    except ConfigError as exc:
        print(f"pdgate router: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn re-raises the SIGINT/SIGTERM it caught once its graceful shutdown is done,
    # restoring the handlers it found first; these make that re-raise a no-op, so a
    # requested shutdown exits 0 instead of dying by signal or with a KeyboardInterrupt.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    uvicorn.run(
        app, host=config.host, port=config.port, loop="auto", http="auto",
        timeout_graceful_shutdown=int(config.shutdown_timeout_s + 0.999),
        log_level=config.log_level, access_log=False,
    )
    return 0
