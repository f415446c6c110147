"""Cross-field checks of the router's settings (`validate_config`) and the one-model
configs a several-model `RouterConfig` stands for (`model_configs`): what the struct types
in router/config.py cannot express. Run once at startup; each error names the field (and
the model, for a field of one of `models`)."""

from __future__ import annotations

import re

import msgspec

from pdgate.router.config import MODEL_LABEL, ROLE_LABEL, ConfigError, RouterConfig
from pdgate.router.engine_urls import engine_url_problem
from pdgate.router.priority import PRIORITY_MAX, PRIORITY_MIN

__all__ = ["model_configs", "validate_config"]

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
_ORIGIN = re.compile(r"https?://[^/\s]+")

_POSITIVE = (
    "connect_timeout_s",
    "prefill_timeout_s",
    "decode_first_byte_timeout_s",
    "decode_idle_timeout_s",
    "health_interval_s",
    "startup_wait_s",
    "health_timeout_s",
    "max_connections",
    "max_body_bytes",
    "prefix_block_size",
    "prefix_index_max_blocks",
    "kv_ready_timeout_s",
    "migration_deadline_s",
    "notify_ttl_s",
    "notify_reap_interval_s",
    "max_concurrent_requests",
    "workers",
    "queue_timeout_s",
    "health_failure_threshold",
    "health_success_threshold",
    "eject_consecutive_errors",
    "breaker_open_s",
    "kv_abort_timeout_s",
    "max_json_depth",
    "max_messages",
    "chat_template_timeout_s",
    "chat_template_max_output_chars",
    "header_timeout_s",
    "max_pending_connections",
    "body_timeout_s",
    "body_chunk_timeout_s",
    "stream_write_timeout_s",
    "max_engine_reply_bytes",
    "max_sse_line_bytes",
)


def validate_config(config: RouterConfig, policy_names: frozenset[str]) -> RouterConfig:
    """Check cross-field rules the struct types cannot express; return `config` unchanged.

    `policy_names` is the set of registered policy types (passed in so this module does not
    import the policies). Raises `ConfigError` naming the offending field (and the model,
    for a field of one of `models`).
    """
    if config.models:
        _validate_models(config, policy_names)
        return config
    if not config.model:
        raise ConfigError("missing required setting --model (YAML `model`, env PDGATE_MODEL)")
    _validate_discovery(config)
    _validate_routing(config)
    _validate_notify(config)
    _validate_resilience(config)
    for field in ("drain_delay_s", "shutdown_timeout_s"):
        if getattr(config, field) < 0:
            raise ConfigError(f"{field}: must be >= 0")
    for field in ("prefill_dp_size", "decode_dp_size"):
        if getattr(config, field) < 0:
            raise ConfigError(f"{field}: must be >= 0 (0: learn it from the engine)")
    for field in ("prefill", "decode"):
        for url in getattr(config, field):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{field}: {url!r} is not an http(s):// URL")
            if (problem := engine_url_problem(url)) is not None:
                raise ConfigError(f"{field}: {problem}")
    for field in ("prefill_policy", "decode_policy"):
        spec = getattr(config, field)
        name = spec if isinstance(spec, str) else spec.type
        if name not in policy_names:
            known = ", ".join(sorted(policy_names))
            raise ConfigError(f"{field}: unknown policy {name!r} (known: {known})")
    for field in _POSITIVE:
        if getattr(config, field) <= 0:
            raise ConfigError(f"{field}: must be > 0")
    if config.max_model_len is not None and config.max_model_len <= 0:
        raise ConfigError("max_model_len: must be > 0")
    for field in ("port", "prefill_port", "decode_port"):
        if not 0 <= getattr(config, field) <= 65535:
            raise ConfigError(f"{field}: must be in 0..65535")
    return config


_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
# A model's own settings: with `models:` they are set per model, never at the top level.
_MODEL_OWN = ("model", "served_model_name", "engine_model_name", "tokenizer", "max_model_len",
              "prefill", "decode", "prefill_selector", "decode_selector", "load_on_demand",
              "lora_adapters")


def model_configs(config: RouterConfig) -> list[RouterConfig]:
    """One one-model config per served model: `config` itself without `models`, else each
    entry of `models` over the top-level settings (its unset fields inherit them). With
    `discovery: k8s`, a model without selectors finds its pods by their labels:
    `pdgate.io/role=<role>,pdgate.io/model=<first served name>`."""
    if not config.models:
        return [config]
    derived = []
    for entry in config.models:
        changes = {name: value for name in entry.__struct_fields__
                   if (value := getattr(entry, name)) is not msgspec.UNSET}
        label = (entry.served_model_name or [entry.model])[0]
        if config.discovery == "k8s" and _LABEL_VALUE.fullmatch(label):
            for role in ("prefill", "decode"):
                if not changes[f"{role}_selector"]:
                    changes[f"{role}_selector"] = f"{ROLE_LABEL}={role},{MODEL_LABEL}={label}"
        derived.append(msgspec.structs.replace(config, models=[], **changes))
    return derived


def _validate_models(config: RouterConfig, policy_names: frozenset[str]) -> None:
    defaults = RouterConfig(model="x")
    for field in _MODEL_OWN:
        if field != "model" and getattr(config, field) != getattr(defaults, field) or \
                field == "model" and config.model:
            raise ConfigError(f"{field}: set it under each of `models` (with `models`, the "
                              "top level describes no model)")
    owner: dict[str, str] = {}
    for i, one in enumerate(model_configs(config)):
        where = f"models[{i}] ({one.model})"
        try:
            validate_config(one, policy_names)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        for name in one.served_names:
            if name in owner:
                raise ConfigError(f"{where}: served_model_name: {name!r} is already served "
                                  f"by {owner[name]}")
            owner[name] = where


def _validate_resilience(config: RouterConfig) -> None:
    for field in ("max_queued_requests", "max_retries", "max_migrations"):
        if getattr(config, field) < 0:
            raise ConfigError(f"{field}: must be >= 0")
    if config.retry_backoff_s < 0:
        raise ConfigError("retry_backoff_s: must be >= 0")
    if not 0 <= config.reserved_slots < config.max_concurrent_requests:
        raise ConfigError("reserved_slots: must be >= 0 and below max_concurrent_requests")
    if config.reserved_slots and config.admission_order != "fair":
        raise ConfigError("reserved_slots: needs admission_order fair (fifo knows no keys)")
    for field in ("api_key", "admin_api_key", "engine_api_key"):
        key = getattr(config, field)
        if key is not None and len(key) < 8:
            raise ConfigError(f"{field}: use at least 8 characters")
    for key in config.api_keys:
        if len(key) < 8:
            raise ConfigError("api_keys: use at least 8 characters per key")
    _validate_client_keys(config)
    for origin in config.cors_allowed_origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ConfigError(f"cors_allowed_origins: {origin!r} is not an origin "
                              "(scheme://host[:port], or *)")
    for name in config.request_id_headers:
        if not _HEADER_NAME.fullmatch(name):
            raise ConfigError(f"request_id_headers: {name!r} is not a header name")


def _validate_client_keys(config: RouterConfig) -> None:
    # Messages name an entry by its index and name, never by its key (a secret).
    names: set[str] = set()
    keys: set[str] = {config.api_key or "", *config.api_keys}
    for i, entry in enumerate(config.client_keys):
        where = f"client_keys[{i}]"
        if len(entry.key) < 8:
            raise ConfigError(f"{where}: key: use at least 8 characters")
        if entry.key in keys or entry.key == config.admin_api_key:
            raise ConfigError(f"{where} ({entry.name}): key: the same key is given twice "
                              "(in api_key, api_keys, admin_api_key or client_keys)")
        keys.add(entry.key)
        if not _LABEL_VALUE.fullmatch(entry.name) or entry.name in names:
            raise ConfigError(f"{where}: name: {entry.name!r} must be unique, 1-63 of "
                              "A-Z a-z 0-9 - _ . (it labels metrics)")
        names.add(entry.name)
        if not PRIORITY_MIN <= entry.priority <= PRIORITY_MAX:
            raise ConfigError(f"{where} ({entry.name}): priority: must be in "
                              f"{PRIORITY_MIN}..{PRIORITY_MAX}")
        if entry.tokens_per_minute is not None and entry.tokens_per_minute <= 0:
            raise ConfigError(f"{where} ({entry.name}): tokens_per_minute: must be > 0 "
                              "(leave it out for no quota)")


def _validate_notify(config: RouterConfig) -> None:
    if "://" not in config.notify_bind:
        raise ConfigError(f"notify_bind: {config.notify_bind!r} is not a zmq endpoint "
                          "(e.g. tcp://0.0.0.0:7500)")
    if config.notify_secret is not None and len(config.notify_secret) < 16:
        raise ConfigError("notify_secret: use at least 16 characters")


def _validate_routing(config: RouterConfig) -> None:
    if config.disagg_min_tokens < 0:
        raise ConfigError("disagg_min_tokens: must be >= 0")
    ratio = config.disagg_prefix_ratio
    if ratio is not None and not 0 < ratio <= 1:
        raise ConfigError("disagg_prefix_ratio: must be in (0, 1]")
    _validate_lora(config)
    interval = config.engine_load_interval_s
    if interval is not None and interval < 0:
        raise ConfigError("engine_load_interval_s: must be >= 0 (0: never)")
    for entry in config.kv_events:
        url, sep, endpoint = entry.rpartition("=")
        if not sep or not url.startswith(("http://", "https://")) or "://" not in endpoint:
            raise ConfigError(
                f"kv_events: {entry!r} is not ENGINE_URL=ENDPOINT "
                "(e.g. http://10.0.0.1:8100=tcp://10.0.0.1:5557)"
            )


def _validate_lora(config: RouterConfig) -> None:
    if config.lora_load_timeout_s <= 0:
        raise ConfigError("lora_load_timeout_s: must be > 0")
    for entry in config.lora_adapters:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"lora_adapters: {entry!r} is not NAME=PATH "
                              "(e.g. sql-lora=/adapters/sql-lora)")


def _validate_discovery(config: RouterConfig) -> None:
    if config.discovery == "k8s":
        # Static URLs may be given too (e.g. an engine outside the cluster).
        for field in ("prefill_selector", "decode_selector"):
            if field == "prefill_selector" and config.pd_mode == "colocated":
                continue
            if not getattr(config, field).strip():
                raise ConfigError(f"{field}: a label selector is required with discovery k8s "
                                  f"(under `models`: default {ROLE_LABEL}=ROLE,{MODEL_LABEL}="
                                  "NAME when the first served name is a label value)")
        if config.k8s_api_url is not None and not config.k8s_api_url.startswith(
            ("http://", "https://")
        ):
            raise ConfigError(f"k8s_api_url: {config.k8s_api_url!r} is not an http(s):// URL")
        return
    if config.pd_mode == "colocated":
        if config.prefill:
            raise ConfigError("prefill: a colocated model has no prefill engines "
                              "(pd_mode colocated: decode pool only)")
    elif not config.prefill:
        raise ConfigError("prefill: at least one prefill engine URL is required")
    if not config.decode:
        raise ConfigError("decode: at least one decode engine URL is required")
