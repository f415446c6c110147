"""``python -m pdgate.proxy``: the standalone KV-ready proxy (see proxy.cli)."""

from __future__ import annotations

from pdgate.proxy.cli import main

raise SystemExit(main())
