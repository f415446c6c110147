"""`python -m router`: run the router (see `router.cli`)."""

from __future__ import annotations

import sys

from router.cli import main

if __name__ == "__main__":
    sys.exit(main())
