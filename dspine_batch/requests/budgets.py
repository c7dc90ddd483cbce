"""Budgets for the user code run on every row: the job's prompt templates (``templates``) and a stage's
``where`` predicate (``stages.where``).

Both are written once and run on rows nobody has read, so a row's data must not be able to make them end the
job. A template or predicate that cannot run at all (syntax, unknown names, nesting too deep for the parser) is
refused when the job is read, before the model loads. What a row can still cause is refused *before* it is
computed, because the process cannot take back a gigabyte it has allocated or a loop it is stuck in:

- sizes: no operation makes a string or list of more than ``MAX_ITEMS`` characters or items (``prompt * 10**10``,
  ``"%999999999s" % x``, ``center(10**9)``), nor an integer of more than ``MAX_INT_BITS`` bits (``10 ** 10**9``);
- work (templates: the only place with loops and calls): ``MAX_ITERATIONS`` loop iterations, ``MAX_CALLS`` calls
  and ``RENDER_SECONDS`` of wall time per render, and a rendered text of at most ``MAX_ITEMS`` characters.

A row that passes one is that row's error (a template) or not kept (``where``), with the budget named in the
reason; ``MemoryError``, ``RecursionError`` and ``OverflowError`` that get through anyway (a comparison of two
deeply nested values, ``int(1e999)``) are caught the same way, so they never end the job.
"""

from __future__ import annotations

import re
import string
from typing import Any

MAX_ITEMS = 10_000_000  # characters of a string, items of a list (10 MB of text: beyond any model's context)
MAX_INT_BITS = 1 << 16  # an integer of about 20,000 digits
MAX_ITERATIONS = 1_000_000  # loop iterations of one render
MAX_CALLS = 100_000  # calls (functions, filters' callables, macros) of one render
RENDER_SECONDS = 2.0  # wall time of one render
CAUGHT = (MemoryError, RecursionError, OverflowError)  # what a row's data can still raise: that row's problem


class OverBudget(Exception):
    """A row's data would make the user's code pass a budget; the message names the budget."""


def too_big(n: int, what: str = "a value") -> OverBudget:
    return OverBudget(f"{what} of {n:,} characters or items (the budget is {MAX_ITEMS:,})")


def check_items(n: int, what: str = "a value") -> None:
    if n > MAX_ITEMS:
        raise too_big(n, what)


def _sized(v: Any) -> bool:
    return isinstance(v, str | bytes | list | tuple)


def _int(v: Any) -> bool:
    return isinstance(v, int)  # bools too: True * "x" is "x"


def check_binop(op: str, left: Any, right: Any) -> None:
    """Refuses, before it runs, the binary operation ``left op right`` (``op``: ``+ - * / // % **``) when its
    result would pass a budget. Everything else is left to Python (a ``TypeError`` is the row's problem too)."""
    if op == "*":
        if _int(left) and _int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise OverBudget(f"an integer of about {left.bit_length() + right.bit_length():,} bits (the budget "
                                 f"is {MAX_INT_BITS:,})")
            return
        seq, times = (left, right) if _int(right) else (right, left)
        if _sized(seq) and _int(times):
            check_items(len(seq) * max(times, 0))
    elif op == "**":
        if _int(left) and _int(right) and right > 0 and abs(left) > 1:
            bits = (abs(left).bit_length() - 1) * right
            if bits > MAX_INT_BITS:
                raise OverBudget(f"an integer of about {bits:,} bits (the budget is {MAX_INT_BITS:,})")
    elif op == "+":
        if _sized(left) and _sized(right):
            check_items(len(left) + len(right))
    elif op == "%":
        if isinstance(left, str):
            check_printf(left)


# a printf conversion: %[(key)][flags][width][.precision][length]type, width/precision possibly '*'
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsa%]")


def check_printf(fmt: str) -> None:
    """A ``%``-format whose widths or precisions would make a string past the budget (``"%999999999s"``)."""
    if "%" not in fmt:
        return
    for m in _PRINTF.finditer(fmt):
        for n in m.groups():
            if n == "*":
                raise OverBudget("a %-format takes its width from the values ('*'): not allowed here")
            if n is not None and int(n) > MAX_ITEMS:
                raise too_big(int(n), "a %-format width")


def check_format(fmt: str) -> None:
    """A ``str.format`` string whose field widths would make a string past the budget (``"{:>999999999}"``);
    a width taken from the values (``"{:{w}}"``) is refused."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # not a valid format string: formatting it fails with this error, the row's problem
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:
            raise OverBudget("a format takes its width from the values ('{:{w}}'): not allowed here")
        for n in re.findall(r"\d+", spec):
            if int(n) > MAX_ITEMS:
                raise too_big(int(n), "a format width")
