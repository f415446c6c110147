"""Router settings: one frozen struct, strictly decoded, validated once at startup.

Sources, later wins: struct defaults < `--config` YAML file < command-line flags. The YAML
file uses the same field names as this struct (flags spell them with dashes). Unknown
fields are an error naming the field, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from pdgate.router.engine_urls import engine_url_problem

__all__ = [
    "REQUEST_ID_HEADERS",
    "MODEL_LABEL",
    "ClientKey",
    "ROLE_LABEL",
    "ConfigError",
    "ModelConfig",
    "PdMode",
    "PolicySpec",
    "RouterConfig",
    "engine_url_problem",
    "load_config",
]

MIB = 1024 * 1024
REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message names the field."""


class PolicySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A routing policy as configured: its registered `type`, an optional display `name`,
    and `params` that the policy itself decodes (see `router.policies`)."""

    type: str
    name: str | None = None
    params: dict[str, Any] = {}


class ClientKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One client API key with its own settings (`client_keys:`; docs/configuration.md).

    `key`: the Bearer key (a secret: accepted on /v1/* like `api_keys`, never logged or
    exported); `name`: how logs, metrics and the fair queue know it. `priority`: the
    earliest priority (vLLM's meaning, lower is earlier) its requests may have, and theirs
    when they ask none (router/priority.py). `tokens_per_minute`: its quota of prompt plus
    completion tokens over any 60 s (router/quotas.py; None: no quota).
    """

    key: str
    name: str
    priority: int = 0
    tokens_per_minute: int | None = None


PdMode = Literal["pull", "notify", "push", "colocated"]
"""How a model's requests run: the three P/D flows, or `colocated` (decode pool only: every
request runs whole on one decode engine, no prefill pool)."""


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model of a router serving several (`models:` in the YAML file).

    The fields mean what the top-level `RouterConfig` fields of the same name mean, for this
    model only; one left out takes the top-level value (policies, decider thresholds, pd_mode,
    discovery ports...). The model's own names, tokenizer and engines are never inherited:
    with `models:` the top level sets none of them (router/model_configs.py).
    `load_on_demand`: LoRA adapters of this model may be loaded on the chosen engines;
    `lora_adapters`: their `NAME=PATH` sources (docs/lora.md).
    """

    model: str
    served_model_name: list[str] = []
    engine_model_name: str | None = None
    tokenizer: str | None = None
    max_model_len: int | None = None
    prefill: list[str] = []
    decode: list[str] = []
    prefill_selector: str = ""
    decode_selector: str = ""
    load_on_demand: bool = False
    lora_adapters: list[str] = []
    prefill_dp_size: int | msgspec.UnsetType = msgspec.UNSET
    decode_dp_size: int | msgspec.UnsetType = msgspec.UNSET
    prefill_port: int | msgspec.UnsetType = msgspec.UNSET
    decode_port: int | msgspec.UnsetType = msgspec.UNSET
    pd_mode: PdMode | msgspec.UnsetType = msgspec.UNSET
    prefill_policy: str | PolicySpec | msgspec.UnsetType = msgspec.UNSET
    decode_policy: str | PolicySpec | msgspec.UnsetType = msgspec.UNSET
    passthrough_role: Literal["decode", "prefill"] | msgspec.UnsetType = msgspec.UNSET
    disagg_min_tokens: int | msgspec.UnsetType = msgspec.UNSET
    disagg_prefix_ratio: float | None | msgspec.UnsetType = msgspec.UNSET
    decider: str | PolicySpec | msgspec.UnsetType = msgspec.UNSET
    early_first_token: bool | msgspec.UnsetType = msgspec.UNSET
    kv_events: list[str] | msgspec.UnsetType = msgspec.UNSET
    prefix_block_size: int | msgspec.UnsetType = msgspec.UNSET
    forward_priority: bool | msgspec.UnsetType = msgspec.UNSET


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything one router process needs. Times are seconds, sizes bytes.

    `prefill` / `decode` are engine base URLs (`http://host:port`, no `/v1`).
    `model` is the tokenizer source and the default served name; `served_model_name`
    lists the names `/v1/models` reports and requests may ask for.
    """

    model: str = ""  # required unless `models` is given (load_config says so)
    # Several models, each with its own pools, mode and policies (router/model_configs.py);
    # empty: the one model the fields below describe.
    models: list[ModelConfig] = []
    # LoRA adapters of the model may be loaded on the engines chosen for a request, from
    # these `NAME=PATH` sources (else the path an engine holding one reports).
    load_on_demand: bool = False
    lora_adapters: list[str] = []
    prefill: list[str] = []
    decode: list[str] = []
    # DP ranks behind each engine URL (vLLM --data-parallel-size with internal load
    # balancing): each rank is routed as an endpoint of its own (router/dp_ranks.py);
    # 0: learn it from each engine's /metrics (router/dp_learn.py).
    prefill_dp_size: int = 1
    decode_dp_size: int = 1
    served_model_name: list[str] = []
    # The name engines know the model by; requests for another served name are rewritten to
    # it, so aliases work with engines that serve one name.
    engine_model_name: str | None = None
    tokenizer: str | None = None
    max_model_len: int | None = None
    pd_mode: PdMode = "pull"
    prefill_policy: str | PolicySpec = "round-robin"
    decode_policy: str | PolicySpec = "least-inflight"
    # Which pool serves the pass-through routes (embeddings, tokenize, ...: one engine, no
    # P/D; router/http/passthrough.py), picked by that pool's policy.
    passthrough_role: Literal["decode", "prefill"] = "decode"
    host: str = "127.0.0.1"
    port: int = 8000
    # Router processes sharing `port` (SO_REUSEPORT), each with its own engine session,
    # health checks, breakers and KV-ready proxy; admission limits are split between them
    # (router/http/workers.py).
    workers: int = 1
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_first_byte_timeout_s: float = 300.0
    decode_idle_timeout_s: float = 60.0
    health_interval_s: float = 5.0
    # A request arriving before any engine pair was ever healthy (router just started) waits
    # up to this long for one instead of failing at once.
    startup_wait_s: float = 10.0
    health_timeout_s: float = 2.0
    max_connections: int = 1024
    engine_keepalive_s: float = 4.0
    max_body_bytes: int = 4 * MIB
    # On SIGTERM: /ready fails and requests are still served this long, then the graceful
    # shutdown (router/http/drain.py). 0 keeps a bare `pdgate router` quick to stop; the
    # chart sets router.drainDelaySeconds.
    drain_delay_s: float = 0.0
    shutdown_timeout_s: float = 10.0
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_format: Literal["text", "json"] = "text"  # router/logs.py
    otlp_traces_endpoint: str | None = None  # router/tracing.py (also OTEL_* env)
    # Where the client's own request id is read from, the first header present wins (the
    # ones vllm-router reads by default); it is echoed, logged and traced, never sent on.
    request_id_headers: list[str] = msgspec.field(
        default_factory=lambda: list(REQUEST_ID_HEADERS))
    # Engine discovery: `static` uses only `prefill`/`decode`; `k8s` also watches pods
    # matching the selectors (label selector syntax) and routes to the ready ones.
    discovery: Literal["static", "k8s"] = "static"
    namespace: str | None = None
    prefill_selector: str = ""
    decode_selector: str = ""
    prefill_port: int = 8000
    decode_port: int = 8000
    engine_scheme: Literal["http", "https"] = "http"
    k8s_api_url: str | None = None
    # Routing: engines' KV block size (prefix hashing), the prefix index bound,
    # engines' KV-events endpoints (`ENGINE_URL=tcp://host:port`), selective disaggregation.
    prefix_block_size: int = 16
    prefix_index_max_blocks: int = 1_000_000
    kv_events: list[str] = []
    disagg_min_tokens: int = 0
    disagg_prefix_ratio: float | None = None
    # LoRA adapters (router/adapters.py, docs/lora.md): learn which engine holds which
    # adapter from its /v1/models with each health probe; how long one load (of a model's
    # `load_on_demand`) may take.
    # (A model's `load_on_demand` or `lora_adapters` turns learning on too: `lora_on`.)
    enable_lora: bool = False
    lora_load_timeout_s: float = 120.0
    # The disaggregate-or-not decider (router/policies/setup.py: build_decider): "static" (the two
    # rules above) or "measured-cost" (predicted TTFT of P then D against D alone, within
    # those rules), a name or a {type, name, params} spec.
    decider: str | PolicySpec = "static"
    # Seconds between reads of each engine's /metrics for its queue and KV usage
    # (router/engine_load.py); None: 1 s when a policy or the decider reads them, else
    # never; 0: never.
    engine_load_interval_s: float | None = None
    # KV-ready proxy (notify mode): the zmq PULL endpoint this router binds (port 0:
    # any free port), the host engines should connect to when it binds a wildcard, the HMAC
    # secret engines sign with, and how long a request waits for its KV.
    notify_bind: str = "tcp://127.0.0.1:0"
    notify_advertise_host: str | None = None
    notify_secret: str | None = None
    kv_ready_timeout_s: float = 30.0
    # The embedded proxy's table: unclaimed early notices and never-awaited waiters live
    # this long; the reaper runs this often.
    notify_ttl_s: float = 60.0
    notify_reap_interval_s: float = 1.0
    # Stream P's first token to the client as soon as P answers (router/flows/early.py).
    early_first_token: bool = True
    # Resilience. Admission: requests served at once, requests waiting for a slot
    # (beyond both: 429), and how long one may wait. Secrets: Bearer keys for the OpenAI
    # routes and for /admin (admin routes exist only when `admin_api_key` is set).
    max_concurrent_requests: int = 1024
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    # Which queued request is admitted next (router/admission.py): "fair" (weighted fair
    # queuing over client keys and priorities) or "fifo" (arrival order).
    admission_order: Literal["fair", "fifo"] = "fair"
    # Slots only a client key (flow) with no request in service may take (fair order):
    # a flooding key never holds them all, so a light key starts at once.
    reserved_slots: int = 0
    # Send each request's priority (router/priority.py) to the engines as vLLM's
    # `priority` on both legs: only for engines run with `--scheduling-policy priority`
    # (vLLM refuses a priority other than 0 otherwise). False: the router orders its own
    # admission by it and removes the field from the legs.
    forward_priority: bool = False
    # Client keys with settings of their own: name, priority, token quota (ClientKey).
    client_keys: list[ClientKey] = []
    api_key: str | None = None
    api_keys: list[str] = []
    # Browser origins allowed by CORS (`*`: any); empty: no CORS headers (router/http/app.py).
    cors_allowed_origins: list[str] = []
    admin_api_key: str | None = None
    # Sent as `Authorization: Bearer` on every engine call (shim `--api-key`, vLLM
    # `--api-key`): engines then serve only this router, not whoever reaches their port.
    engine_api_key: str | None = None
    # Health: probe verdicts need this many failures / successes in a row; this many errors
    # in a row on real requests open an engine's circuit breaker for `breaker_open_s`.
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    eject_consecutive_errors: int = 3
    breaker_open_s: float = 10.0
    # Failover: extra attempts per leg on other engines, base of the jittered backoff
    # between attempts, and the deadline of the best-effort KV abort sent to P.
    max_retries: int = 1
    retry_backoff_s: float = 0.02
    # Mid-stream migration (router/flows/migration.py): continuations per stream whose
    # decode engine failed after the first byte (0: off), each opened within the deadline.
    max_migrations: int = 2
    migration_deadline_s: float = 30.0
    # Non-streaming requests too, run as streams the router reads (off: a plain one costs
    # 2.4 times the router's instructions that way; docs/flows.md "Mid-stream migration").
    migrate_non_streaming: bool = False
    kv_abort_timeout_s: float = 2.0
    # Hostile input (router/input/limits.py): request parsing bounds, client-supplied chat
    # templates (off unless allowed; rendered sandboxed, off the event loop, with a budget),
    # client-side deadlines (headers, body, slow SSE readers) and engine reply bounds.
    max_json_depth: int = 32
    max_messages: int = 2048
    # "auto": tokenize prompts only when a policy, the decider or the flow needs the tokens
    # (engines check the context length); "always": also to refuse what cannot fit and to
    # render chat templates in the router's sandbox before any engine sees them.
    tokenize_prompts: Literal["auto", "always"] = "auto"
    allow_client_chat_template: bool = False
    chat_template_timeout_s: float = 2.0
    chat_template_max_output_chars: int = 4 * MIB
    header_timeout_s: float = 10.0
    # Connections that have not completed a request (new, or inside a request's headers or
    # body), per process; more are answered 503 and closed before anything is read.
    max_pending_connections: int = 1024
    body_timeout_s: float = 30.0
    body_chunk_timeout_s: float = 10.0
    stream_write_timeout_s: float = 30.0
    max_engine_reply_bytes: int = 64 * MIB
    max_sse_line_bytes: int = 4 * MIB

    @property
    def lora_on(self) -> bool:
        """Whether the router learns and routes LoRA adapters: `enable_lora`, or any model
        that may load adapters or names their sources."""
        if self.enable_lora or self.load_on_demand or self.lora_adapters:
            return True
        return any(m.load_on_demand or m.lora_adapters for m in self.models)

    @property
    def served_names(self) -> list[str]:
        """Names clients may put in `model` (defaults to `[model]`)."""
        return list(self.served_model_name) or [self.model]

    @property
    def engine_model(self) -> str:
        """The `model` engines receive (default: the first served name, as vLLM's
        `--served-model-name` treats its first entry)."""
        return self.engine_model_name or self.served_names[0]

    @property
    def client_api_keys(self) -> list[str]:
        """Every key accepted on `/v1/*`: `api_key`, `api_keys` and the keys of
        `client_keys` (empty: open)."""
        keys = [self.api_key] if self.api_key else []
        keys += [k for k in self.api_keys if k not in keys]
        return keys + [c.key for c in self.client_keys if c.key not in keys]

    @property
    def tokenizer_source(self) -> str:
        """Path or hub name the tokenizer loads from (defaults to `model`)."""
        return self.tokenizer or self.model


# Engine pods' labels that k8s discovery selects a model's pods by (router/discovery.py).
ROLE_LABEL = "pdgate.io/role"
MODEL_LABEL = "pdgate.io/model"


def load_config(
    yaml_path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> RouterConfig:
    """Build a `RouterConfig` from an optional YAML file plus `overrides` (flag values).

    Decoding is strict: an unknown or mistyped field raises `ConfigError` with its name.
    Cross-field validation is `validate_config`'s job.
    """
    raw: dict[str, Any] = {}
    if yaml_path is not None:
        raw.update(_read_yaml(Path(yaml_path)))
    raw.update(overrides or {})
    try:
        return msgspec.convert(raw, RouterConfig)
    except msgspec.ValidationError as exc:
        source = f"{yaml_path}: " if yaml_path is not None else ""
        message = _name_the_model_setting(str(exc), raw) or _name_the_setting(str(exc))
        raise ConfigError(f"{source}{message}") from None


def _name_the_model_setting(message: str, raw: dict[str, Any]) -> str | None:
    """msgspec's message for a field of one of `models`, naming that model and field
    (`models[1] (llama-8b): pd_mode: Invalid enum value 'pul'`); None for other fields."""
    at = re.search(r" - at `\$\.models\[(\d+)\](?:\.(\w+))?", message)
    if at is None:
        return None
    i = int(at.group(1))
    entries = raw.get("models")
    entry = entries[i] if isinstance(entries, list) and i < len(entries) else None
    name = entry.get("model") if isinstance(entry, dict) else None
    where = f"models[{i}]" + (f" ({name})" if isinstance(name, str) else "")
    text = message[:at.start()]
    if (missing := re.fullmatch(r"Object missing required field `(\w+)`", text)):
        return f"{where}: missing required field `{missing.group(1)}`"
    if (unknown := re.fullmatch(r"Object contains unknown field `(\w+)`", text)):
        return f"{where}: unknown field `{unknown.group(1)}`"
    return f"{where}: {at.group(2) or 'entry'}: {text}"


def _name_the_setting(message: str) -> str:
    """msgspec's message with the setting named as a user gives it: the flag, the YAML key
    and the environment variable (`Object missing required field `model``, `... - at `$.port``)."""
    missing = re.fullmatch(r"Object missing required field `(\w+)`", message)
    field = missing.group(1) if missing else None
    if field is None and (at := re.search(r" - at `\$\.(\w+)`", message)):
        field = at.group(1)
    if field is None:
        return message
    names = f"--{field.replace('_', '-')} (YAML `{field}`, env PDGATE_{field.upper()})"
    if missing:
        return f"missing required setting {names}"
    return f"{names}: {message[:message.index(' - at ')]}"


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = msgspec.yaml.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of field names")
    return data
