"""Whether this router needs a tokenizer, and loading it only then.

The router reads a prompt's tokens only for a few features; with none of them configured
(round-robin, least-inflight, power-of-two or session policies in pull mode, no length or
prefix rule) it forwards prompts untouched and the engines check the context length. Such
a router starts without a tokenizer, so `--model` may be a served name with no local files
and no model hub. A router that needs one and cannot load it fails at startup, naming the
features that need it and the `--tokenizer` flag.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdgate.router.config import ConfigError, RouterConfig
from pdgate.router.input.tokenization import PromptTokenizer, load_tokenizer
from pdgate.router.policies.registry import build_policy

__all__ = ["TOKEN_FEATURES", "log_no_tokenizer", "open_migration_tokenizer", "open_tokenizer",
           "token_readers"]

log = logging.getLogger(__name__)

TOKEN_FEATURES = ("prefix-aware and kv-events policies, --pd-mode notify and push, "
                  "--disagg-min-tokens, --disagg-prefix-ratio, --decider measured-cost, "
                  "--tokenize-prompts always")
"""Every feature that reads prompt tokens, as the startup log names them."""


def token_readers(config: RouterConfig) -> list[str]:
    """The configured features that read the prompt's tokens (empty: no tokenizer needed).

    Policies are asked through their scorers (`Selector.needs_tokens`), so a new policy
    that hashes tokens is counted without a change here."""
    readers = []
    for field in ("prefill_policy", "decode_policy"):
        selector = build_policy(getattr(config, field))
        if selector.needs_tokens:
            readers.append(f"the {selector.type} policy (--{field.replace('_', '-')})")
    if config.pd_mode in ("notify", "push"):  # notify reserves D's blocks, push names its size
        readers.append(f"--pd-mode {config.pd_mode}")
    if config.disagg_min_tokens > 0:
        readers.append("--disagg-min-tokens")
    if config.disagg_prefix_ratio:  # 0 or unset: the prefix rule is off
        readers.append("--disagg-prefix-ratio")
    decider = config.decider if isinstance(config.decider, str) else config.decider.type
    if decider != "static":  # the measured-cost decider predicts per prompt length
        readers.append(f"--decider {decider}")
    if config.tokenize_prompts == "always":
        readers.append("--tokenize-prompts always")
    return readers


def open_tokenizer(config: RouterConfig, readers: list[str]) -> PromptTokenizer | None:
    """Load `config.tokenizer_source` if `readers` (from `token_readers`) is not empty,
    else None. Blocking (call at startup). Raises `ConfigError` when it cannot load."""
    if not readers:
        return None
    try:
        return load_tokenizer(config.tokenizer_source, config.model, config.max_model_len)
    except ImportError as exc:  # transformers is not in the core install: the hf extra
        raise ConfigError(
            f"tokenizer: {exc.name or 'transformers'} is not installed. A tokenizer is "
            f"needed by {' and '.join(readers)}: install the hf extra "
            "(pip install 'pdgate[hf]'), or configure none of these") from None
    except (OSError, ValueError) as exc:  # what transformers raises for a missing tokenizer
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(
            f"tokenizer: cannot load {config.tokenizer_source!r} ({reason}). A tokenizer is "
            f"needed by {' and '.join(readers)}: pass --tokenizer with a local directory or "
            "model hub name that has a tokenizer.json, or configure none of these") from None


def open_migration_tokenizer(config: RouterConfig) -> PromptTokenizer | None:
    """The tokenizer mid-stream migration uses (router/flows/migration.py) in a router that
    tokenizes nothing else: loaded when `--max-migrations` is on and the tokenizer is a
    local directory or was named with `--tokenizer` (a model name alone is never looked up
    on a hub for this). None, with a warning, when it cannot load: streams then do not
    migrate."""
    source = config.tokenizer_source
    if config.max_migrations <= 0 or not (config.tokenizer or Path(source).is_dir()):
        return None
    try:
        return load_tokenizer(source, config.model, config.max_model_len)
    except (ImportError, OSError, ValueError) as exc:
        log.warning("mid-stream migration is off: its tokenizer %r cannot load (%s)",
                    source, " ".join(str(exc).split())[:200] or type(exc).__name__)
        return None


def log_no_tokenizer() -> None:
    """The startup line of a router that tokenizes nothing (logged from the lifespan: the
    CLI sets up logging after the app is built)."""
    log.info("prompts are not tokenized: nothing configured reads prompt tokens (a "
             "tokenizer, --tokenizer or else --model, is needed by %s)", TOKEN_FEATURES)
