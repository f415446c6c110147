"""`pdgate router --help` and `--version`: flags in argument groups, metavars that say
what a value is, and the version of the installed package."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Literal, get_args

import msgspec

from pdgate.router.cli import _GROUPS, build_parser
from pdgate.router.config import RouterConfig

ROOT = Path(__file__).parents[2]
GROUPS = ["engines", "routing", "flows", "limits", "security", "observability", "deployment"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdgate.cli", "router", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_router_version() -> None:
    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pdgate ") and out.stdout.split()[1][0].isdigit()


def test_help_is_in_groups_and_every_field_is_in_exactly_one() -> None:
    out = run("--help")
    assert out.returncode == 0, out.stderr
    headings = [line[:-1] for line in out.stdout.splitlines() if line.endswith(":")
                and not line.startswith(" ")]
    assert headings[-len(GROUPS):] == GROUPS
    grouped = [f for _, fields in _GROUPS for f in fields]
    assert sorted(grouped) == sorted(f.name for f in msgspec.structs.fields(RouterConfig))
    assert "--vllm-pd-disaggregation" not in out.stdout  # vllm-router spellings: hidden


def test_metavars_say_what_the_value_is() -> None:
    types = {f.name: f.type for f in msgspec.structs.fields(RouterConfig)}
    for action in build_parser()._actions:
        field = action.dest
        if field not in types or action.help == argparse.SUPPRESS:
            continue
        typ = types[field]
        if getattr(typ, "__origin__", None) is Literal:
            assert action.choices == get_args(typ), field
            continue
        floats = typ is float or (float in get_args(typ) and int not in get_args(typ))
        if action.metavar == "SECONDS":
            assert floats and field.endswith("_s"), field
        if floats and field.endswith("_s"):
            assert action.metavar == "SECONDS", field
    tokenize = next(a for a in build_parser()._actions if a.dest == "tokenize_prompts")
    assert tokenize.choices == ("auto", "always") and tokenize.metavar is None
