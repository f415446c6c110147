"""Router settings: one frozen struct, strictly decoded, validated once at startup.

Sources, later wins: struct defaults < `--config` YAML file < command-line flags. The YAML
file uses the same field names as this struct (flags spell them with dashes). Unknown
fields are an error naming the field, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = ["ConfigError", "RouterConfig", "load_config", "validate_config"]

MIB = 1024 * 1024


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message names the field."""


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything one router process needs. Times are seconds, sizes bytes.

    `prefill` / `decode` are engine base URLs (`http://host:port`, no `/v1`).
    `model` is the tokenizer source and the default served name; `served_model_name`
    lists the names `/v1/models` reports and requests may ask for.
    """

    model: str
    prefill: list[str] = []
    decode: list[str] = []
    served_model_name: list[str] = []
    tokenizer: str | None = None
    max_model_len: int | None = None
    pd_mode: Literal["pull"] = "pull"
    prefill_policy: str = "round-robin"
    decode_policy: str = "least-inflight"
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_first_byte_timeout_s: float = 300.0
    decode_idle_timeout_s: float = 60.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    max_connections: int = 1024
    engine_keepalive_s: float = 4.0
    max_body_bytes: int = 4 * MIB
    shutdown_timeout_s: float = 10.0
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @property
    def served_names(self) -> list[str]:
        """Names clients may put in `model` (defaults to `[model]`)."""
        return list(self.served_model_name) or [self.model]

    @property
    def tokenizer_source(self) -> str:
        """Path or hub name the tokenizer loads from (defaults to `model`)."""
        return self.tokenizer or self.model


_POSITIVE = (
    "connect_timeout_s",
    "prefill_timeout_s",
    "decode_first_byte_timeout_s",
    "decode_idle_timeout_s",
    "health_interval_s",
    "health_timeout_s",
    "max_connections",
    "max_body_bytes",
)


def validate_config(config: RouterConfig, policy_names: frozenset[str]) -> RouterConfig:
    """Check cross-field rules the struct types cannot express; return `config` unchanged.

    `policy_names` is the set of registered policy types (passed in so this module does not
    import the policies). Raises `ConfigError` naming the offending field.
    """
    if not config.prefill:
        raise ConfigError("prefill: at least one prefill engine URL is required")
    if not config.decode:
        raise ConfigError("decode: at least one decode engine URL is required")
    for field in ("prefill", "decode"):
        for url in getattr(config, field):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{field}: {url!r} is not an http(s):// URL")
    for field in ("prefill_policy", "decode_policy"):
        name = getattr(config, field)
        if name not in policy_names:
            known = ", ".join(sorted(policy_names))
            raise ConfigError(f"{field}: unknown policy {name!r} (known: {known})")
    for field in _POSITIVE:
        if getattr(config, field) <= 0:
            raise ConfigError(f"{field}: must be > 0")
    if config.max_model_len is not None and config.max_model_len <= 0:
        raise ConfigError("max_model_len: must be > 0")
    if not 0 <= config.port <= 65535:
        raise ConfigError("port: must be in 0..65535")
    return config


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
        raise ConfigError(f"{source}{exc}") from None


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
