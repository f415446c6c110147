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
    from pdgate.router.cli import main

    return main(argv)


# The engine needs these; the router's install leaves them out (the `shim` extra).
SHIM_MODULES = ("torch", "nixl", "safetensors", "numpy")
# nixl: the meta package, or NIXL's CUDA 13 build alone (what the shim extra installs).
_PROVIDERS = {"nixl": ("nixl", "nixl_cu13")}


def missing_shim_modules() -> list[str]:
    from importlib.util import find_spec

    return [name for name in SHIM_MODULES
            if all(find_spec(m) is None for m in _PROVIDERS.get(name, (name,)))]


def _shim_extra_missing(command: str) -> int | None:
    """Exit status 2 with the install line when the `shim` extra is absent, else None."""
    missing = missing_shim_modules()
    if not missing:
        return None
    print(f"pdgate {command}: the engine shim needs the `shim` extra, which is not installed "
          f"(missing: {', '.join(missing)}).\n"
          "Install it with: pip install 'pdgate[shim]' "
          "(CPU torch first: pip install torch --index-url https://download.pytorch.org/whl/cpu)",
          file=sys.stderr)
    return 2


def _shim_main(argv: list[str]) -> int:
    refused = _shim_extra_missing("shim")
    if refused is not None:
        return refused
    from pdgate.engine_shim.cli import main

    return main(argv)


def _up_main(argv: list[str]) -> int:
    refused = _shim_extra_missing("up")
    if refused is not None:
        return refused
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
