"""The shim's secrets from a flag, an environment variable or a mounted file.

The one module that knows the shim's secret variables (`cli.main` passes `os.environ` in):

    secret             flag              variable               or a file named by
    engine API key     --api-key         PDGATE_ENGINE_API_KEY  PDGATE_ENGINE_API_KEY_FILE
    KV-ready HMAC key  --notify-secret   PDGATE_NOTIFY_SECRET   PDGATE_NOTIFY_SECRET_FILE

A flag wins over the environment (flags are visible in `ps`, so deployments should prefer
the variables). As in the router (`router/settings_env.py`): an empty variable counts as
unset, so a chart may render it unconditionally; setting both a variable and its `_FILE` is
an error; one trailing newline of a file is stripped (a Kubernetes secret mount's). Unlike
an empty variable, an empty or unreadable file is an error: someone meant to set a key, and
starting without one would leave the engine open.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdgate.common.secret_files import SecretFileError, read_secret_file

__all__ = [
    "API_KEY_ENV",
    "MIN_API_KEY_CHARS",
    "NOTIFY_SECRET_ENV",
    "CredentialError",
    "api_key",
    "notify_secret",
]

API_KEY_ENV = "PDGATE_ENGINE_API_KEY"
NOTIFY_SECRET_ENV = "PDGATE_NOTIFY_SECRET"
MIN_API_KEY_CHARS = 8  # as the router's keys: refuses placeholders like "x" or "1234"
_FILE = "_FILE"


class CredentialError(ValueError):
    """A secret that cannot be used; the message names the flag, variable or file."""


def api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The engine API key (None: the engine is unauthenticated)."""
    key = _secret(flag, "--api-key", API_KEY_ENV, environ)
    if key is not None and len(key) < MIN_API_KEY_CHARS:
        raise CredentialError(f"the engine API key must have at least {MIN_API_KEY_CHARS} "
                              "characters")
    return key


def notify_secret(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The HMAC key of KV-ready notifications (None: unsigned)."""
    return _secret(flag, "--notify-secret", NOTIFY_SECRET_ENV, environ)


def _secret(flag: str | None, flag_name: str, var: str,
            environ: Mapping[str, str]) -> str | None:
    if flag is not None:
        if not flag:
            raise CredentialError(f"{flag_name} is empty")
        return flag
    value = environ.get(var, "").strip()
    path = environ.get(var + _FILE, "")
    if value and path:
        raise CredentialError(f"{var} and {var}{_FILE} are both set; use one")
    if path:
        return _read_file(var + _FILE, path)
    return value or None


def _read_file(var: str, path: str) -> str:
    try:
        secret = read_secret_file(var, path)
    except SecretFileError as e:
        raise CredentialError(str(e)) from None
    if not secret:  # a mounted but empty secret must not leave the engine open
        raise CredentialError(f"{var}: {path} is empty")
    return secret
