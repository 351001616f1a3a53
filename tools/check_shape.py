"""Check the code shape rules ruff does not: function length and cyclomatic complexity.

- No function longer than 60 lines. A function's length counts its lines from the first
  statement after its docstring to its last line (the docstring is documentation).
- No function above complexity 15, as radon computes it (radon counts boolean operators
  and comprehensions, which ruff's mccabe check does not, so it is the stricter measure).

Run by ``make lint``::

    python tools/check_shape.py kvconnector_core connectors examples

Exits 1 and names each function over a limit; prints a one-line summary otherwise.
"""

from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_COMPLEXITY = 15


def _body_start(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    is_docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str))
    if is_docstring and len(node.body) > 1:
        return node.body[1].lineno
    return node.lineno


def function_lengths(path: Path) -> list[tuple[int, str]]:
    """``(lines, "file:line name")`` of every function and method in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [((node.end_lineno or node.lineno) - _body_start(node) + 1,
             f"{path}:{node.lineno} {node.name}")
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def complexities(path: Path) -> list[tuple[int, str]]:
    """``(complexity, "file:line name")`` of every function and method in ``path``."""
    from radon.complexity import cc_visit
    from radon.visitors import Function

    found: set[tuple[int, str]] = set()  # radon lists methods with their class and alone
    for block in cc_visit(path.read_text(encoding="utf-8")):
        funcs = [block] if isinstance(block, Function) else [*block.methods]
        found |= {(f.complexity, f"{path}:{f.lineno} {f.fullname}") for f in funcs}
        found |= {(c.complexity, f"{path}:{c.lineno} {c.fullname}")
                  for f in funcs for c in f.closures}
    return sorted(found)


def main(argv: list[str]) -> int:
    """Check every ``*.py`` under the given folders; returns the exit status."""
    files = sorted(p for arg in argv for p in Path(arg).rglob("*.py"))
    lengths = [item for f in files for item in function_lengths(f)]
    if not lengths:
        print("check_shape: no functions found under", " ".join(argv))
        return 1
    too_long = sorted((n, where) for n, where in lengths if n > MAX_FUNCTION_LINES)
    for n, where in too_long:
        print(f"{where}: {n} lines (at most {MAX_FUNCTION_LINES}, docstring excluded)")
    complex_ = sorted((c, where) for f in files for c, where in complexities(f)
                      if c > MAX_COMPLEXITY)
    for c, where in complex_:
        print(f"{where}: complexity {c} (at most {MAX_COMPLEXITY})")
    counts = [n for n, _ in lengths]
    longest = max(lengths)
    print(f"check_shape: {len(files)} files, {len(counts)} functions, median "
          f"{statistics.median(counts):g} lines, longest {longest[0]} ({longest[1]})")
    return 1 if too_long or complex_ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
