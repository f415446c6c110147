"""The docs stay true: no stale markers (promises of figures not measured, work-log
narrative, pointers to issue numbers or to documents outside the repository) in the docs
or in the sources' comments and docstrings, and every repository path the docs name in
backticks or links exists. The checker is itself tested on planted mistakes, so an empty
result cannot mean it looked at nothing."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# `\s+` between words, so a phrase broken across lines counts too.
STALE = [re.compile(p, re.IGNORECASE) for p in (
    r"not\s+measured\s+yet",
    r"does\s+not\s+exist\s+(in\s+the\s+shim\s+)?yet",
    r"\bissue\s+#?\d+\b",
    r"design\.md",
    r"this\s+session",
    r"before this .* fix",  # within one line
    r"§\d",
)]
# Backtick spans that name a repository path: these top-level entries, then a path. The
# package paths (`router/flows/pull.py`) are read from src/pdgate/, as the docs say.
_PACKAGES = ("router/", "proxy/", "engine_shim/", "contract/", "common/")
_TOP = (*_PACKAGES, "src/", "tests/", "bench/", "docs/", "helm/",
        ".ci/", "Makefile", "Dockerfile", "pyproject.toml", "README.md")
_BACKTICK = re.compile(r"`([^`\s]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATHLIKE = re.compile(r"[\w./-]+")
PYTHON_DIRS = ("src", "bench", "tests")


def doc_files(root: Path = ROOT) -> list[Path]:
    """Every document the checks cover."""
    files = [root / "README.md", root / "src" / "pdgate" / "engine_shim" / "README.md",
             *sorted((root / "docs").glob("*.md")), *sorted((root / "helm").rglob("README*"))]
    return [f for f in files if f.is_file()]


def python_files(root: Path = ROOT) -> list[Path]:
    """The repository's Python sources."""
    out = [path for top in PYTHON_DIRS for path in sorted((root / top).rglob("*.py"))]
    return [p for p in out if p != Path(__file__).resolve()]


def stale_markers(name: str, text: str) -> list[str]:
    """`name:line: marker` for each stale marker in `text` (the line it starts on)."""
    found = []
    for pattern in STALE:
        for m in pattern.finditer(text):
            lineno = text.count("\n", 0, m.start()) + 1
            found.append((lineno, f"{name}:{lineno}: {' '.join(m.group(0).split())!r}"))
    return [hit for _, hit in sorted(found)]


def prose_of_python(source: str) -> str:
    """The comments and docstrings of a Python module, each on its original lines (the
    rest blanked), so that line numbers in reports match the file."""
    lines = [""] * (source.count("\n") + 1)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0] - 1] += tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc = body[0].value
                if isinstance(doc.value, str):
                    for i, line in enumerate(doc.value.splitlines()):
                        lines[doc.lineno - 1 + i] += " " + line
    return "\n".join(lines)


def named_paths(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line, path, is_link) for each repository path in backticks and each relative link."""
    for lineno, line in enumerate(text.splitlines(), 1):
        for span in _BACKTICK.findall(line):
            path = re.sub(r":\d+$", "", span).rstrip(".,;")
            if path.startswith(_TOP) and _PATHLIKE.fullmatch(path):
                yield lineno, path, False
        for target in _LINK.findall(line):
            target = target.split("#", 1)[0]
            if target and not re.match(r"[a-z]+:", target):
                yield lineno, target, True


def missing_paths(doc: Path, root: Path = ROOT) -> list[str]:
    """`doc:line: path` for each path `doc` names that does not exist (backtick paths are
    from the repository root, links from the document's folder)."""
    name = doc.relative_to(root) if doc.is_relative_to(root) else doc
    return [f"{name}:{lineno}: {path}"
            for lineno, path, link in named_paths(doc.read_text())
            if not (doc.parent / path if link else path_base(root, path) / path).exists()]


def path_base(root: Path, path: str) -> Path:
    """Where a backtick path is read from: src/pdgate/ for a package path, else the root."""
    return root / "src" / "pdgate" if path.startswith(_PACKAGES) else root


def test_docs_have_no_stale_markers() -> None:
    found = [hit for doc in doc_files()
             for hit in stale_markers(str(doc.relative_to(ROOT)), doc.read_text())]
    assert found == []


def test_python_comments_and_docstrings_have_no_stale_markers() -> None:
    found = [hit for path in python_files()
             for hit in stale_markers(str(path.relative_to(ROOT)),
                                      prose_of_python(path.read_text()))]
    assert found == []


def test_paths_named_in_the_docs_exist() -> None:
    assert [hit for doc in doc_files() for hit in missing_paths(doc)] == []


def test_the_checks_cover_the_docs_and_sources() -> None:
    names = {str(d.relative_to(ROOT)) for d in doc_files()}
    assert {"README.md", "docs/architecture.md", "src/pdgate/engine_shim/README.md"} <= names
    assert len(python_files()) > 100
    paths = [p for d in doc_files() for _, p, _ in named_paths(d.read_text())]
    assert "docs/architecture.md" in paths and len(paths) > 50


def test_the_checker_catches_planted_mistakes(tmp_path: Path) -> None:
    doc = tmp_path / "planted.md"
    doc.write_text("Figures: not measured yet (see Issue #12, §3 of design.md). It does\n"
                   "  not exist yet.\n"
                   "Read `router/flows/pull.py`, `router/no_such_module.py` and "
                   "[the flows](../no_such_doc.md); [ok](planted.md#top), "
                   "[web](https://example.com/x.md).\n")
    assert len(stale_markers("planted.md", doc.read_text())) == 5
    assert "planted.md:1: 'does not exist yet'" in stale_markers("planted.md", doc.read_text())
    missing = missing_paths(doc)
    assert missing == [f"{doc}:3: router/no_such_module.py", f"{doc}:3: ../no_such_doc.md"]
    source = ('"""Module docstring, as it was before this session."""\n'
              'x = "issue 7 in a string is code, not prose"\n'
              'def f() -> None:\n    """Fixed before this cache fix."""\n'
              'y = 1  # see issue 42\n')
    hits = stale_markers("planted.py", prose_of_python(source))
    assert hits == ["planted.py:1: 'this session'", "planted.py:4: 'before this cache fix'",
                    "planted.py:5: 'issue 42'"]
