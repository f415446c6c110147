"""No module over 500 lines: small modules with one job (docs/architecture.md). A module
that is a table (of flags, settings or metrics) may be longer if its docstring or a comment
in its first 20 lines says `a table of ...`, which a reader can check at a glance."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pdgate"
LIMIT = 500
_TABLE = re.compile(r"\ba table of\b", re.I)


def too_long(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > LIMIT and not _TABLE.search("\n".join(lines[:20])):
            out.append(f"{path.relative_to(root.parent)}: {len(lines)} lines")
    return out


def test_no_module_is_over_500_lines_unless_it_says_it_is_a_table() -> None:
    assert too_long(SRC) == []


def test_the_check_sees_a_long_module_and_accepts_a_declared_table(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    (pkg / "flags.py").write_text('"""A table of flags."""\n' + "y = 2\n" * (LIMIT + 1))
    (pkg / "short.py").write_text("z = 3\n" * LIMIT)
    assert too_long(pkg) == [f"pkg/long.py: {LIMIT + 1} lines"]
