"""`python -m pdgate.router`: run the router (see `router.cli`)."""

from __future__ import annotations

import sys

from pdgate.router.cli import main

if __name__ == "__main__":
    sys.exit(main())
