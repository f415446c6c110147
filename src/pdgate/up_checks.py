"""`pdgate up`'s checks of its own arguments, before anything starts: a refusal is one line
on stderr and exit code 2, as argparse's own."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

__all__ = ["is_tiny", "refusal"]


def is_tiny(model_dir: Path) -> bool:
    """Whether `model_dir` holds the built-in tiny model (its config is the tiny one)."""
    from pdgate.engine_shim.tiny import TINY_CONFIG

    try:
        return bool(json.loads((model_dir / "config.json").read_text()) == TINY_CONFIG)
    except (OSError, ValueError):
        return False


def refusal(args: argparse.Namespace) -> str | None:
    """Why `pdgate up` cannot run with `args`, or None."""
    if args.prefill < 1 or args.decode < 1:
        return "need at least one prefill and one decode engine"
    if not 0 <= args.colocated_models <= args.models or args.models < 1:
        return "--models must be >= 1 and --colocated-models in 0..--models"
    engines = args.models * args.decode + (args.models - args.colocated_models) * args.prefill
    if args.cores_per_engine < 0 or engines * args.cores_per_engine > (os.cpu_count() or 1):
        return (f"--cores-per-engine {args.cores_per_engine}: {engines} engines, "
                f"{os.cpu_count()} cores")
    if not any(d.strip() for d in args.device.split(",")):
        return "--device names no device"
    if args.models > 1 and args.model != "tiny" and not is_tiny(Path(args.model)):
        return "--models N > 1 serves seeded copies of the built-in tiny model (--model tiny)"
    for flag, key in (("--api-key", args.api_key), ("--engine-api-key", args.engine_api_key)):
        if key is not None and len(key) < 8:
            return f"{flag}: use at least 8 characters"
    return None
