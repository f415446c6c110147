"""Generates the CLI reference (docs/cli.md) from the real parsers, so the two cannot drift.

`python -m pdgate.cli_docs` prints the section; `--write docs/cli.md` replaces it in place
(between the `<!-- cli:begin -->` and `<!-- cli:end -->` markers). A test fails when the
page is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BEGIN, END = "<!-- cli:begin -->", "<!-- cli:end -->"


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from pdgate.engine_shim.cli import build_parser as shim_parser
    from pdgate.proxy.cli import build_parser as proxy_parser
    from pdgate.router.cli import build_parser as router_parser
    from pdgate.up import build_parser as up_parser

    return [("pdgate up", up_parser()), ("pdgate router", router_parser()),
            ("pdgate shim", shim_parser()), ("python -m pdgate.proxy", proxy_parser())]


def _row(action: argparse.Action) -> str:
    flags = ", ".join(f"`{s}`" for s in action.option_strings)
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS, False) else f"`{default}`"
    if isinstance(default, list):
        shown = "" if not default else f"`{default}`"
    help_text = (action.help or "").replace("|", "\\|").replace("\n", " ")
    if action.choices:
        help_text += " (choices: " + ", ".join(str(c) for c in action.choices) + ")"
    return f"| {flags} | {shown} | {help_text} |"


def render() -> str:
    out: list[str] = []
    for name, parser in _parsers():
        out += [f"### `{name}`", "", parser.description or "", "",
                "| flag | default | meaning |", "|---|---|---|"]
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                if "--help" not in action.option_strings:
                    out.append(_row(action))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def replace_section(text: str, section: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{section}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    section = render()
    if args[:1] == ["--write"]:
        path = Path(args[1] if len(args) > 1 else "docs/cli.md")
        path.write_text(replace_section(path.read_text(), section))
    else:
        print(section, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
