"""`python -m pdgate.engine_shim [flags]`: run one engine shim (see `engine_shim.cli`)."""

from __future__ import annotations

import sys

from pdgate.engine_shim.cli import main

if __name__ == "__main__":
    sys.exit(main())
