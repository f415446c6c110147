"""The router's environment-variable overlay: the one module that reads `PDGATE_*` settings.

Every `RouterConfig` field `foo_bar` can be set by `PDGATE_FOO_BAR` (containers and Helm
charts configure processes this way). Secret fields may instead name a file with
`PDGATE_<FIELD>_FILE` (a mounted Kubernetes secret; one trailing newline is stripped), so a
secret never has to sit in the pod spec or in `ps` output. Precedence, later wins:
defaults < `--config` YAML < environment < command-line flags.

Values are strings: list fields are comma-separated (`PDGATE_API_KEYS=k1,k2`) except `models`
and `client_keys` (`PDGATE_MODELS`, `PDGATE_CLIENT_KEYS`: JSON lists of objects), booleans are
`true/false/1/0/yes/no/on/off`, numbers are parsed by the config decoder, and a policy may be
a name or a JSON object (`{"type": "prefix-aware", "params": {...}}`). An empty variable is
ignored, so a chart can render a variable unconditionally.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

import msgspec

from pdgate.common.secret_files import SecretFileError, read_secret_file
from pdgate.router.config import ConfigError, RouterConfig

__all__ = ["ENV_PREFIX", "SECRET_FIELDS", "env_name", "env_overrides", "env_reference"]

ENV_PREFIX = "PDGATE_"
SECRET_FIELDS = frozenset(
    {"api_key", "api_keys", "admin_api_key", "engine_api_key", "notify_secret", "client_keys"}
)
_JSON_LISTS = {"models": "models", "client_keys": "client key objects"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(field: str) -> str:
    """The variable that sets `field`, e.g. `pd_mode` -> `PDGATE_PD_MODE`."""
    return ENV_PREFIX + field.upper()


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config overrides from `environ` (raw strings and lists; the config decoder converts
    numbers). Raises `ConfigError` naming the variable when a value cannot be used."""
    out: dict[str, Any] = {}
    for field in msgspec.structs.fields(RouterConfig):
        raw = _raw_value(field.name, environ)
        if raw is None:
            continue
        out[field.name] = _convert(field.name, field.type, raw)
    return out


def env_reference() -> list[tuple[str, str]]:
    """(variable, field) for every setting, for the generated configuration reference."""
    rows = []
    for field in msgspec.structs.fields(RouterConfig):
        rows.append((env_name(field.name), field.name))
        if field.name in SECRET_FIELDS:
            rows.append((env_name(field.name) + "_FILE", field.name))
    return rows


def _raw_value(field: str, environ: Mapping[str, str]) -> str | None:
    name = env_name(field)
    value = environ.get(name, "")
    file_name = environ.get(name + "_FILE", "") if field in SECRET_FIELDS else ""
    if value and file_name:
        raise ConfigError(f"{name} and {name}_FILE are both set; use one")
    if file_name:
        return _read_secret_file(name + "_FILE", file_name)
    return value.strip() or None


def _read_secret_file(var: str, path: str) -> str | None:
    try:
        return read_secret_file(var, path) or None
    except SecretFileError as exc:
        raise ConfigError(str(exc)) from None


def _convert(field: str, typ: Any, raw: str) -> Any:
    origin = getattr(typ, "__origin__", None)
    if field in _JSON_LISTS:  # lists of objects: JSON (a chart renders them with toJson)
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            # Not the text: client_keys hold secrets.
            raise ConfigError(f"{env_name(field)}: invalid JSON list of "
                              f"{_JSON_LISTS[field]}: {exc}") from None
    if origin is list:
        return [item.strip() for item in raw.split(",") if item.strip()]
    if typ is bool:
        low = raw.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ConfigError(f"{env_name(field)}: {raw!r} is not a boolean (true/false)")
    if field.endswith("_policy") and raw.startswith("{"):
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{env_name(field)}: invalid JSON policy: {exc}") from None
    base = _without_none(typ)
    if base is int or base is float:
        try:
            return base(raw)
        except ValueError:
            raise ConfigError(f"{env_name(field)}: {raw!r} is not a number") from None
    return raw


def _without_none(typ: Any) -> Any:
    args = [a for a in get_args(typ) if a is not type(None)]
    return args[0] if len(args) == 1 else typ
