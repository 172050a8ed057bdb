"""The house rules on size: no source file over 600 lines, no function over 120. A long file
or function is where several concepts hide; split it along its data flow."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("alpac", "passes", "runtime") for p in sorted((ROOT / d).rglob("*.py"))]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 120


def test_no_source_file_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in SOURCES
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, "\n".join(long)


def test_no_function_over_120_lines():
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} {n} lines")
    assert not long, "\n".join(long)
