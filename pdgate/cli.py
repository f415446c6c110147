"""`pdgate` console script: one entry point, one subcommand per process kind.

Each subcommand owns its parser in its own package, so this module only dispatches and
imports the chosen package lazily: `pdgate router` never loads torch or nixl.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: pdgate {router,shim,up} [options] | pdgate --version

Disaggregated prefill/decode serving gateway.

subcommands:
  router   OpenAI-compatible P/D router in front of prefill and decode engines
  shim     engine shim: a Llama-style engine with paged KV and NIXL transfer
  up       a local cluster (N prefill + M decode shims and a router) in the foreground

Run `pdgate <subcommand> --help` for the options of each.
"""


def _router_main(argv: list[str]) -> int:
    from router.cli import main

    return main(argv)


def _shim_main(argv: list[str]) -> int:
    from engine_shim.cli import main

    return main(argv)


def _up_main(argv: list[str]) -> int:
    from pdgate.up import main

    return main(argv)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "router": _router_main,
    "shim": _shim_main,
    "up": _up_main,
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"pdgate {_version()}")
        return 0
    command = SUBCOMMANDS.get(args[0])
    if command is None:
        print(f"pdgate: unknown subcommand {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
