"""Reading a secret from a mounted file (Kubernetes secret volumes, `*_FILE` variables).

Shared by the router's and the engine shim's settings (both may import `proxy`). Bounded in
size, UTF-8 only, one trailing newline stripped (secret mounts usually end with one).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MAX_SECRET_FILE_BYTES", "SecretFileError", "read_secret_file"]

MAX_SECRET_FILE_BYTES = 64 * 1024


class SecretFileError(ValueError):
    """The file cannot be used as a secret; the message names the variable and path."""


def read_secret_file(var: str, path: str) -> str:
    """The secret in `path` (named by variable `var`), without its trailing newline; may be
    empty (callers decide what an empty secret means)."""
    try:
        data = Path(path).read_bytes()[: MAX_SECRET_FILE_BYTES + 1]
    except OSError as exc:
        raise SecretFileError(f"{var}: cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretFileError(f"{var}: {path} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise SecretFileError(f"{var}: {path} is not UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")
