"""Command line for the router: `python -m pdgate.router` and `pdgate router`.

Every flag sets the `RouterConfig` field of the same name (dashes for underscores).
Precedence, later wins: defaults < `--config` YAML < `PDGATE_*` environment variables
(router/settings_env.py) < flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, Literal, get_args

import msgspec

from pdgate.router import __version__
from pdgate.router.cli_vllm import add_vllm_router_flags, prefill_urls, vllm_router_overrides
from pdgate.router.config import ConfigError, RouterConfig, load_config
from pdgate.router.settings_env import env_overrides

__all__ = ["build_parser", "main"]

_DEFAULTS = {f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
             for f in msgspec.structs.fields(RouterConfig)}

_METAVARS = {
    "model": "PATH_OR_NAME", "tokenizer": "PATH_OR_NAME", "prefill": "URL", "decode": "URL",
    "served_model_name": "NAME", "engine_model_name": "NAME", "pd_mode": "MODE",
    "prefill_policy": "POLICY", "decode_policy": "POLICY", "host": "ADDR", "log_level": "LEVEL",
    "log_format": "FORMAT",
    "otlp_traces_endpoint": "URL",
    "discovery": "MODE", "namespace": "NAME", "prefill_selector": "LABELS",
    "decode_selector": "LABELS", "prefill_port": "PORT", "decode_port": "PORT",
    "engine_scheme": "SCHEME", "k8s_api_url": "URL",
    "kv_events": "URL=ENDPOINT", "disagg_prefix_ratio": "RATIO", "lora_adapters": "NAME=PATH",
    "decider": "DECIDER",
    "notify_bind": "ENDPOINT", "notify_advertise_host": "HOST", "notify_secret": "SECRET",
    "api_key": "KEY", "api_keys": "KEY", "admin_api_key": "KEY", "engine_api_key": "KEY",
    "cors_allowed_origins": "ORIGIN", "request_id_headers": "HEADER",
}

# (field, type, help). Lists are repeatable flags; the default is appended to the help.
_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("model", str, "model directory or hub name: tokenizer source and default served name"),
    ("models", "json", "several models, each with its own engines, pd_mode and policies: a "
                       "JSON list of model objects (usually `models:` in the --config YAML; "
                       "docs/configuration.md); the other model flags then stay unset"),
    ("load_on_demand", bool, "LoRA adapters (with --enable-lora): the router loads an "
                             "adapter the chosen engine lacks (vLLM /v1/load_lora_adapter; "
                             "the engine needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), one "
                             "load per engine and adapter (per model under `models`)"),
    ("prefill", list, "prefill engine base URL, e.g. http://10.0.0.1:8100 (repeatable); "
                      "vllm-router's `URL BOOTSTRAP_PORT` or `URL none` is accepted (the port "
                      "is ignored: pdgate's KV handshake needs none)"),
    ("decode", list, "decode engine base URL, e.g. http://10.0.0.2:8200 (repeatable)"),
    ("prefill_dp_size", int, "data-parallel ranks behind each prefill URL (vLLM "
                             "--data-parallel-size N, internal load balancing): each rank "
                             "is routed to as its own engine, pinned with "
                             "X-data-parallel-rank; 0: learn it from each engine's "
                             "/metrics (vLLM's engine labels)"),
    ("decode_dp_size", int, "data-parallel ranks behind each decode URL (as "
                            "--prefill-dp-size)"),
    ("served_model_name", list, "model name clients may request (repeatable; "
                                "default: --model)"),
    ("engine_model_name", str, "model name the engines serve: a request for any served name "
                               "is sent to the engines under this one (default: the first "
                               "--served-model-name)"),
    ("tokenizer", str, "tokenizer directory or hub name (default: --model)"),
    ("max_model_len", int, "context length in tokens (default: from the model's "
                           "config.json or the tokenizer)"),
    ("pd_mode", str, "disaggregation flow: pull (vLLM NixlConnector: D READs P's KV); "
                     "notify (P WRITEs into D's reserved blocks, tells this router's proxy); "
                     "push (both legs at once; D registers its blocks with P); colocated "
                     "(no prefill pool: each request runs whole on a decode engine)"),
    ("prefill_policy", str, "how to pick a prefill engine: round-robin, least-inflight, "
                            "power-of-two, random, session, consistent-hash, prefix-aware, "
                            "prefix-text, kv-events, load-aware, or vllm-router's names "
                            "(params: YAML {type, name, params})"),
    ("decode_policy", str, "how to pick a decode engine (same choices as --prefill-policy)"),
    ("passthrough_role", str, "the engines serving the pass-through routes (/v1/embeddings, "
                              "/v1/rerank, /v1/score, /v1/responses, /tokenize, /detokenize, "
                              "/version: one engine, no disaggregation), picked by that "
                              "role's policy"),
    ("host", str, "address to listen on"),
    ("port", int, "port to listen on"),
    ("workers", int, "router processes sharing the port (SO_REUSEPORT), each with its own "
                     "engine connections, health checks and KV-ready proxy (notify port + "
                     "worker index); admission limits are split between them"),
    ("connect_timeout_s", float, "seconds to open a TCP connection to an engine"),
    ("prefill_timeout_s", float, "seconds for the whole prefill leg"),
    ("decode_first_byte_timeout_s", float, "seconds until a decode engine answers"),
    ("decode_idle_timeout_s", float, "max seconds between two chunks of a decode reply"),
    ("health_interval_s", float, "seconds between engine health checks (GET /health)"),
    ("health_timeout_s", float, "seconds one health check may take"),
    ("startup_wait_s", float, "seconds a request arriving before the engines were first "
                              "healthy waits for them (engines are probed every 0.2 s "
                              "until ready)"),
    ("max_connections", int, "max pooled connections to all engines together"),
    ("engine_keepalive_s", float, "seconds an idle engine connection is kept open"),
    ("max_body_bytes", int, "largest accepted request body in bytes (larger: 413)"),
    ("drain_delay_s", float, "seconds the router drains on SIGTERM before shutting down: "
                             "/ready answers 503 while requests are still served (0: shut "
                             "down at once; router/http/drain.py)"),
    ("shutdown_timeout_s", float, "seconds to let in-flight requests finish on shutdown"),
    ("log_level", str, "log severity (`warn` = warning)"),
    ("log_format", str, "log lines as text or as one JSON object each (with the request id; "
                        "one access line per request)"),
    ("request_id_headers", list, "request headers the client's request id is taken from, "
                                 "the first present wins (space-separated; echoed in "
                                 "X-Request-Id, logged and traced; engines never see it)"),
    ("otlp_traces_endpoint", str, "OpenTelemetry: OTLP/HTTP URL spans are sent to, e.g. "
                                  "http://otel-collector:4318/v1/traces (default: off, "
                                  "unless OTEL_EXPORTER_OTLP_*ENDPOINT is set; needs the "
                                  "otel extra)"),
    ("prefix_block_size", int, "engines' KV block size in tokens, used to hash prompt "
                               "prefixes for prefix-aware routing"),
    ("prefix_index_max_blocks", int, "bound of each prefix index in (engine, block) "
                                     "entries; least recently used dropped first"),
    ("kv_events", list, "an engine's KV-events publisher (vLLM --kv-events-config), "
                        "ENGINE_URL=tcp://host:port (repeatable)"),
    ("disagg_min_tokens", int, "prompts shorter than this run on a decode engine alone "
                               "(0: always disaggregate)"),
    ("enable_lora", bool, "route LoRA adapter requests (also on with --load-on-demand or "
                          "--lora-adapters): learn which engine holds which "
                          "adapter from its /v1/models with each health probe; an adapter "
                          "request goes only to a P and a D that both hold it"),
    ("lora_adapters", list, "a LoRA adapter's source for --load-on-demand, NAME=PATH as "
                            "the engines see the path (repeatable; per model under "
                            "`models`; default: the path an engine holding it reports)"),
    ("lora_load_timeout_s", float, "max seconds one adapter load may take (then 503)"),
    ("disagg_prefix_ratio", float, "run on a decode engine alone when one already holds at "
                                   "least this fraction (0..1] of the prompt (default: off)"),
    ("decider", str, "whether to disaggregate each request: static (--disagg-min-tokens, "
                     "--disagg-prefix-ratio) or measured-cost (the cheaper predicted time to "
                     "first token of P then D or D alone, within those bounds; params: YAML "
                     "{type, params})"),
    ("engine_load_interval_s", float, "seconds between reads of each engine's /metrics "
                                      "(queue, KV usage) for load-aware policies, the "
                                      "measured-cost decider and the dashboard (default: 1 "
                                      "when one of those reads them; 0: never)"),
    ("discovery", str, "where engines come from: static (--prefill/--decode); k8s (watch "
                       "pods by label; --prefill/--decode may add fixed ones)"),
    ("namespace", str, "k8s: namespace to watch (default: the router pod's own)"),
    ("prefill_selector", list, "k8s: label selector of prefill pods, comma- or "
                               "space-separated, e.g. app=pdgate,pdgate.io/role=prefill"),
    ("decode_selector", list, "k8s: label selector of decode pods (as --prefill-selector)"),
    ("prefill_port", int, "k8s: HTTP port of discovered prefill engines"),
    ("decode_port", int, "k8s: HTTP port of discovered decode engines"),
    ("engine_scheme", str, "k8s: URL scheme of discovered engines"),
    ("k8s_api_url", str, "k8s: API server URL (default: in-cluster, from the service "
                         "account; an http:// URL sends no token)"),
    ("notify_bind", str, "notify mode: zmq endpoint of this router's KV-ready proxy (port 0: "
                         "a free port)"),
    ("notify_advertise_host", str, "notify mode: host engines connect to for KV-ready "
                                   "notices (default: the bound host)"),
    ("notify_secret", str, "notify mode: shared secret (>= 16 chars) engines sign KV-ready "
                           "notices with (engines: --notify-secret)"),
    ("kv_ready_timeout_s", float, "notify mode: seconds a request waits for its KV-ready "
                                  "notice before failing with 504; push mode: seconds the "
                                  "decode engine waits for the pushed KV (push_deadline)"),
    ("notify_ttl_s", float, "notify mode: seconds the KV-ready proxy keeps an unclaimed "
                            "notice or a never-awaited waiter"),
    ("notify_reap_interval_s", float, "notify mode: seconds between the proxy's sweeps of "
                                      "expired notices and waiters"),
    ("early_first_token", bool, "stream the prefill engine's first token to the client at "
                                "once; the decode engine continues after it (every mode; "
                                "pull: completions streams, engines answering "
                                "return_token_ids as vLLM does)"),
    ("max_concurrent_requests", int, "requests served at once; more wait in the queue"),
    ("max_queued_requests", int, "requests waiting for a slot; beyond that: 429 with "
                                 "Retry-After (0: no queue)"),
    ("queue_timeout_s", float, "seconds a queued request waits for a slot before its 429"),
    ("admission_order", str, "which queued request gets the next slot: fair (weighted fair "
                             "queuing over client keys and priorities: a lower priority "
                             "gets twice the share per step) or fifo (arrival order)"),
    ("reserved_slots", int, "of --max-concurrent-requests, slots only a client key (at a "
                            "priority) with no request in service may take (fair order): "
                            "a flooding key never holds them all, so a key sending one "
                            "request at a time starts at once (default 0)"),
    ("forward_priority", bool, "send each request's priority (body `priority`, header "
                               "X-Request-Priority, client_keys) to the engines as "
                               "`priority` on both legs: only for engines run with "
                               "--scheduling-policy priority (vLLM); off: the router "
                               "orders its queue by it and removes it from the legs"),
    ("api_key", str, "Bearer key required on /v1/* (default: open). Prefer env "
                     "PDGATE_API_KEY or PDGATE_API_KEY_FILE (flags show in ps). /health, "
                     "/ready and /metrics stay open"),
    ("api_keys", list, "another accepted client key (repeatable; env PDGATE_API_KEYS, "
                       "comma-separated)"),
    ("client_keys", "json", "client keys with settings of their own: a JSON list of "
                            "{key, name, priority, tokens_per_minute} objects (each key is "
                            "accepted like --api-keys; priority: the earliest its requests "
                            "may ask; tokens_per_minute: a sliding-window quota). Prefer "
                            "env PDGATE_CLIENT_KEYS_FILE or the --config YAML (flags show "
                            "in ps)"),
    ("cors_allowed_origins", list, "browser origins allowed by CORS (space-separated; "
                                   "`*`: any): preflight OPTIONS answered, CORS headers on "
                                   "responses (default: no CORS headers)"),
    ("admin_api_key", str, "Bearer key of the /admin API and /dashboard; without it the "
                           "admin API is off (env PDGATE_ADMIN_API_KEY)"),
    ("engine_api_key", str, "key sent as 'Authorization: Bearer' on every engine call "
                            "(shim/vLLM --api-key; env PDGATE_ENGINE_API_KEY)"),
    ("health_failure_threshold", int, "failed health checks in a row that mark an engine "
                                      "unhealthy"),
    ("health_success_threshold", int, "passing health checks in a row that mark it healthy "
                                      "again"),
    ("eject_consecutive_errors", int, "failed requests in a row that open an engine's "
                                      "circuit breaker (ejected from routing)"),
    ("breaker_open_s", float, "seconds an open breaker keeps an engine out before one trial "
                              "request (half-open)"),
    ("max_retries", int, "extra attempts per leg on other engines, before the first byte"),
    ("retry_backoff_s", float, "base of the exponential, jittered pause between attempts"),
    ("max_migrations", int, "continuations of a stream whose decode engine failed after "
                            "the first byte (a new P/D attempt over prompt + tokens sent; "
                            "0: off)"),
    ("migration_deadline_s", float, "seconds from a decode failure within which a "
                                    "stream's continuation must open (else the stream "
                                    "ends with the error event)"),
    ("migrate_non_streaming", bool, "migrate non-streaming requests too: the router runs "
                                    "their decode leg as a stream it reads and assembles "
                                    "the answer (costs router CPU per token; off: a decode "
                                    "engine failing mid-generation is retried from the "
                                    "start)"),
    ("kv_abort_timeout_s", float, "deadline of the best-effort request asking an engine to "
                                  "free what it holds for a failed or abandoned request (every "
                                  "mode: P's blocks, D's reservation or push registration)"),
    ("max_json_depth", int, "deepest nesting of arrays/objects accepted in a request body "
                            "(deeper: 400)"),
    ("max_messages", int, "most chat messages in one request (more: 400)"),
    ("tokenize_prompts", str, "auto: tokenize prompts only when a policy, the decider or "
                              "the flow needs the tokens; always: also to refuse prompts "
                              "that cannot fit and render chat templates in the router"),
    ("allow_client_chat_template", bool, "accept a client-supplied chat_template (rendered "
                                         "in a sandbox with a time and size budget)"),
    ("chat_template_timeout_s", float, "seconds a client chat_template may take to render "
                                       "(longer: 400)"),
    ("chat_template_max_output_chars", int, "largest prompt a client chat_template may "
                                            "render, in characters (larger: 400)"),
    ("header_timeout_s", float, "seconds a client has to send its request headers"),
    ("max_pending_connections", int, "most client connections, per process, that have not "
                                     "completed a request (new, or inside its headers or "
                                     "body); a new one beyond it is answered 503 and closed "
                                     "before anything is read"),
    ("body_timeout_s", float, "seconds a client has to send its whole request body (408)"),
    ("body_chunk_timeout_s", float, "max seconds between two chunks of a request body (408)"),
    ("stream_write_timeout_s", float, "seconds a streamed chunk may wait for a client that "
                                      "does not read; then the stream is cut"),
    ("max_engine_reply_bytes", int, "largest non-streaming engine reply read (larger: 502)"),
    ("max_sse_line_bytes", int, "longest SSE line read from an engine (longer: the stream "
                                "ends with an error event)"),
)


# --help sections, in order; every field is in exactly one (a test checks).
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engines", ("model", "models", "load_on_demand", "prefill", "decode", "prefill_dp_size",
                 "decode_dp_size",
                 "served_model_name", "engine_model_name",
                 "tokenizer", "max_model_len", "discovery", "namespace", "prefill_selector",
                 "decode_selector", "prefill_port", "decode_port", "engine_scheme",
                 "k8s_api_url", "connect_timeout_s", "max_connections", "engine_keepalive_s",
                 "health_interval_s", "health_timeout_s", "health_failure_threshold",
                 "health_success_threshold", "startup_wait_s")),
    ("routing", ("prefill_policy", "decode_policy", "passthrough_role", "prefix_block_size",
                 "prefix_index_max_blocks", "kv_events", "disagg_min_tokens",
                 "disagg_prefix_ratio", "decider", "engine_load_interval_s", "enable_lora",
                 "lora_adapters", "lora_load_timeout_s", "eject_consecutive_errors",
                 "breaker_open_s", "max_retries", "retry_backoff_s", "max_migrations",
                 "migration_deadline_s", "migrate_non_streaming")),
    ("flows", ("pd_mode", "early_first_token", "prefill_timeout_s",
               "decode_first_byte_timeout_s", "decode_idle_timeout_s", "kv_abort_timeout_s",
               "kv_ready_timeout_s", "notify_bind", "notify_advertise_host", "notify_secret",
               "notify_ttl_s", "notify_reap_interval_s")),
    ("limits", ("max_concurrent_requests", "max_queued_requests", "queue_timeout_s",
                "admission_order", "reserved_slots", "forward_priority",
                "max_body_bytes", "max_json_depth", "max_messages", "tokenize_prompts",
                "allow_client_chat_template", "chat_template_timeout_s",
                "chat_template_max_output_chars", "header_timeout_s",
                "max_pending_connections", "body_timeout_s",
                "body_chunk_timeout_s", "stream_write_timeout_s", "max_engine_reply_bytes",
                "max_sse_line_bytes")),
    ("security", ("api_key", "api_keys", "client_keys", "admin_api_key", "engine_api_key",
                  "cors_allowed_origins")),
    ("observability", ("log_level", "log_format", "otlp_traces_endpoint",
                       "request_id_headers")),
    ("deployment", ("host", "port", "workers", "drain_delay_s",
                    "shutdown_timeout_s")),
)
# List flags taking several values in one occurrence (vllm-router's spelling), still
# repeatable; the rest take one value per occurrence.
_MULTI = frozenset({"prefill", "prefill_selector", "decode_selector", "cors_allowed_origins",
                    "request_id_headers"})
# Space- or comma-separated label selectors become one comma-separated selector.
_JOINED = frozenset({"prefill_selector", "decode_selector"})
_FIELD_TYPES = {f.name: f.type for f in msgspec.structs.fields(RouterConfig)}


def build_parser() -> argparse.ArgumentParser:
    """The router's argument parser. Unset flags are absent from the namespace, so they
    do not override values from `--config`."""
    parser = argparse.ArgumentParser(
        prog="pdgate router",
        usage="%(prog)s --model NAME --prefill URL --decode URL [options]",
        description="OpenAI-compatible prefill/decode disaggregating router.",
        epilog="vllm-router's flags are accepted too: docs/migrating-from-vllm-router.md.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action="version", version=f"pdgate {__version__}")
    parser.add_argument("--config", metavar="YAML",
                        help="YAML file with RouterConfig fields (flags override it)")
    flags = {field: (typ, text) for field, typ, text in _FLAGS}
    for title, fields in _GROUPS:
        group = parser.add_argument_group(title)
        for field in fields:
            typ, text = flags[field]
            _add_flag(group, field, typ, text)
    add_vllm_router_flags(parser)
    return parser


def _add_flag(group: argparse._ArgumentGroup, field: str, typ: Any, text: str) -> None:
    flag = "--" + field.replace("_", "-")
    default = _DEFAULTS.get(field, msgspec.NODEFAULT)
    if default not in (msgspec.NODEFAULT, None, [], ""):
        text = f"{text} (default: {' '.join(default) if isinstance(default, list) else default})"
    choices = _choices(field)
    metavar: Any = None if choices else _metavar(field, typ)
    if field == "prefill":
        metavar = ("URL", "BOOTSTRAP_PORT")  # shown as `URL [BOOTSTRAP_PORT ...]`
    if field in _MULTI:
        nargs = "+" if field == "prefill" or field in _JOINED else "*"
        group.add_argument(flag, action="append", nargs=nargs, metavar=metavar, help=text)
    elif typ is list:
        group.add_argument(flag, action="append", metavar=metavar, help=text)
    elif typ == "json":
        group.add_argument(flag, type=_json_list, metavar="JSON", help=text)
    elif typ is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
    else:
        convert = _log_level if field == "log_level" else typ
        group.add_argument(flag, type=convert, choices=choices, metavar=metavar, help=text)


def _choices(field: str) -> tuple[str, ...] | None:
    """A Literal-typed field's values (argparse checks them and --help lists them)."""
    typ = _FIELD_TYPES.get(field)
    if getattr(typ, "__origin__", None) is Literal:
        return get_args(typ)
    return None


def _metavar(field: str, typ: Any) -> str:
    if field in _METAVARS:
        return _METAVARS[field]
    if typ is int:
        return "N"
    if typ is float:
        return "SECONDS" if field.endswith("_s") else "X"
    return "VALUE"


def _json_list(value: str) -> list[Any]:
    try:
        found = msgspec.json.decode(value)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(found, list):
        raise argparse.ArgumentTypeError("expected a JSON list of objects")
    return found


def _log_level(value: str) -> str:
    return "warning" if value == "warn" else value  # vllm-router's Rust spelling


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse `argv` into a `RouterConfig` (YAML file, then flags). Raises `ConfigError`.
    Warnings about accepted-but-ignored flags go to stderr."""
    args = vars(build_parser().parse_args(argv))
    yaml_path = args.pop("config", None)
    args, warnings = vllm_router_overrides(args)
    if "prefill" in args:
        args["prefill"], more = prefill_urls(args["prefill"])
        warnings += more
    _flatten_lists(args)
    for text in warnings:
        print(f"pdgate router: warning: {text}", file=sys.stderr)
    return load_config(yaml_path, {**env_overrides(os.environ), **args})


def _flatten_lists(args: dict[str, Any]) -> None:
    """Multi-value flags arrive as lists of lists: flatten them; join selectors."""
    for field in (_MULTI - {"prefill"}) & args.keys():
        values = [v for group in args[field] for v in group]
        if field in _JOINED:
            parts = [p for v in values for p in v.replace(",", " ").split()]
            values = ",".join(parts)  # type: ignore[assignment]
        args[field] = values


def main(argv: list[str] | None = None) -> int:
    """Run the router until SIGINT/SIGTERM. Returns the process exit status."""
    try:
        config = config_from_args(argv)
        from pdgate.router.http.app import create_app  # after parsing: --help stays fast
        from pdgate.router.http.drain import Drain

        drain = Drain()
        app = create_app(config, drain=drain)  # validates every setting before serving
    except ConfigError as exc:
        print(f"pdgate router: error: {exc}", file=sys.stderr)
        return 2
    from pdgate.router.http.server import serve, setup_process_logging

    if config.workers > 1:
        from pdgate.router.http.workers import run_workers

        setup_process_logging(config)
        return run_workers(config)  # each worker builds its own app
    return serve(config, app=app, drain=drain)
