"""``where``: a stage's filter, a predicate over its own rows in a small expression language users already know
(Python's comparison syntax: ``score >= 4 and reason != ""``, ``kind in ["a", "b"]``, ``len(questions) > 1``,
``judge.score >= 4``), parsed by ``ast`` into a tree and walked here. Nothing is ever passed to ``eval``: only the
node kinds below exist, names read the row's fields, and the only calls are a handful of pure functions. A
predicate that uses anything else, or that is longer or deeper than a predicate needs to be (``MAX_CHARS``,
``MAX_DEPTH``, ``MAX_NODES``), is refused when the job is read, before the model loads, naming the stage.

On a row it runs under the budgets of ``requests.budgets``: an operation whose result would pass them
(``len(prompt * 10000000000)``) is refused before it runs, and the row is not kept, with the reason in its
``dropped_by`` — as for a missing field or a value of the wrong type (``int(score)`` on ``1e999``). No row can end
the job. The language has no loops, so the work of one test is bounded by the predicate's size and the row's.

Why our walker and not a SQL engine (DuckDB evaluating ``score >= 4`` over the committed Arrow batch): we weighed
it and kept the walker, for now, because
- a stage's fields are not a table: they are each row's parsed JSON output over its parent's context, and rows of
  one stage disagree (a field missing in one row, a string where another has a number). A SQL predicate binds
  against one schema per batch, so one row's odd output would fail or retype the whole batch; here it is that
  row's reason (``where score >= 4: no field 'score'``), kept beside the row;
- the syntax is already in use (README, ``jobs/recipes/``): ``reason != ""`` is an identifier in SQL, ``kind in
  ["a", "b"]`` is no SQL at all, so a switch needs a migration path for every job file written;
- the decision is taken per row as it reaches its stage's sink and committed with it; a batch engine would need
  the sink to hold rows back for a query, and DuckDB (a 66 MB shared library, today a test dependency) would become
  a runtime dependency of one stage option;
- what a SQL engine would add is vectorised speed on millions of rows, while a stage's rows are each one model
  answer (a few per second to a few thousand), so the walker costs nothing measurable beside generation.
Best-of-n's per-group ranking (``select``) came without it too: a group is the n rows of one root, ranked by a sort
of n numbers once the group is complete (``stages.select``).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dspine_batch.requests.budgets import CAUGHT, OverBudget, check_binop

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
}
_BINARY: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub), ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv), ast.Mod: ("%", operator.mod),
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "len": len, "lower": lambda s: str(s).lower(), "upper": lambda s: str(s).upper(), "strip": lambda s: str(s).strip(),
    "int": int, "float": float, "str": str, "abs": abs, "min": min, "max": max,
}
MAX_CHARS = 2000  # a predicate's text
MAX_DEPTH = 32  # nesting of its tree (``not not ... x``, ``((((x))))``)
MAX_NODES = 500  # nodes of its tree
_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class Missing(Exception):
    """A name the row does not have."""


@dataclass(frozen=True)
class Predicate:
    """A checked predicate: ``text`` as written, ``names`` the row fields it reads."""

    text: str
    tree: ast.Expression = field(compare=False, repr=False)
    names: tuple[str, ...] = ()

    def test(self, row: Mapping[str, Any]) -> tuple[bool, str | None]:
        """(kept, why not): False with the reason when the predicate is false, a field is missing or a value has
        the wrong type (the row is then not kept, never an error)."""
        try:
            ok = bool(_eval(self.tree.body, row))
        except Missing as e:
            return False, f"where {self.text}: no field {e}"
        except OverBudget as e:
            return False, f"where {self.text}: over budget: {e}"
        except (TypeError, ValueError, ZeroDivisionError, KeyError, IndexError, AttributeError, *CAUGHT) as e:
            return False, f"where {self.text}: {type(e).__name__}: {str(e)[:120] or 'out of memory'}"
        return (True, None) if ok else (False, f"where {self.text}")


def parse_where(text: str) -> Predicate:
    """The predicate, checked: a ``ValueError`` with a one-line reason when it is not one we can evaluate."""
    text = text.strip()
    if len(text) > MAX_CHARS:
        raise ValueError(f"{len(text):,} characters: a predicate has at most {MAX_CHARS:,}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a predicate ({e.msg} at column {e.offset})") from e
    except (RecursionError, MemoryError) as e:  # Python's parser gives up on deep nesting with these
        raise ValueError(f"nested too deeply (at most {MAX_DEPTH} levels)") from e
    _check_size(tree)
    names: list[str] = []
    for node in ast.walk(tree):
        _check(node)
        if isinstance(node, ast.Name) and node.id not in _CONSTANTS and node.id not in _FUNCTIONS:
            names.append(node.id)
    return Predicate(text, tree, tuple(dict.fromkeys(names)))


_ALLOWED = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd, ast.Compare,
            ast.BinOp, ast.Name, ast.Load, ast.Constant, ast.Attribute, ast.Subscript, ast.List, ast.Tuple, ast.Call,
            *_COMPARE, *_BINARY)


def _check_size(tree: ast.AST) -> None:
    """The tree's depth and size within ``MAX_DEPTH``/``MAX_NODES`` (walked with a stack, not recursion): the walk
    below recurses once per level."""
    stack, count = [(tree, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise ValueError(f"nested too deeply (at most {MAX_DEPTH} levels)")
        if count > MAX_NODES:
            raise ValueError(f"too long (at most {MAX_NODES} terms)")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _check(node: ast.AST) -> None:
    if not isinstance(node, _ALLOWED):
        raise ValueError(f"{type(node).__name__.lower()} is not allowed (comparisons, and/or/not, arithmetic, "
                         f"fields, literals and {', '.join(sorted(_FUNCTIONS))}())")
    if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                                           and not node.keywords):
        raise ValueError(f"only these functions may be called: {', '.join(sorted(_FUNCTIONS))}")
    if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        raise ValueError(f"field {node.attr!r} is not allowed")


def _eval(node: ast.AST, row: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if node.id not in row:
            raise Missing(repr(node.id))
        return row[node.id]
    if isinstance(node, ast.Attribute):  # a nested field: judge.score
        base = _eval(node.value, row)
        if not isinstance(base, Mapping) or node.attr not in base:
            raise Missing(repr(node.attr))
        return base[node.attr]
    if isinstance(node, ast.Subscript):
        return _eval(node.value, row)[_eval(node.slice, row)]
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(v, row) for v in node.values)
        return any(_eval(v, row) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, row)
        return (not v) if isinstance(node.op, ast.Not) else (-v if isinstance(node.op, ast.USub) else +v)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, row)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, row)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BinOp):
        symbol, op = _BINARY[type(node.op)]
        left, right = _eval(node.left, row), _eval(node.right, row)
        check_binop(symbol, left, right)  # before it runs: ``prompt * 10000000000`` never allocates
        return op(left, right)
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval(e, row) for e in node.elts]
    if isinstance(node, ast.Call):
        return _FUNCTIONS[node.func.id](*[_eval(a, row) for a in node.args])  # type: ignore[attr-defined]
    raise ValueError(f"{type(node).__name__} is not allowed")  # unreachable: _check refused it
