"""``python -m proxy``: the standalone KV-ready proxy (see proxy.cli)."""

from __future__ import annotations

from proxy.cli import main

raise SystemExit(main())
