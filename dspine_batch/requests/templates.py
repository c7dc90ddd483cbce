"""Prompts built from a row's columns: ``--prompt-template`` (the user turn) and ``--system-template``.

Jinja2 in its sandbox (``SandboxedEnvironment``: no attribute access to Python internals, no calls to unsafe
callables) with ``StrictUndefined``: a name the template uses that the row lacks is an error, never an empty
string silently pasted into a prompt. Nested values read as attributes or items (``{{ judge.score }}``,
``{{ doc["title"] }}``: a Parquet struct or a JSON object arrives as a dict). The columns a template reads are
found once from its syntax tree (``jinja2.meta``), so the pipeline reads only those and an input whose schema lacks
one is refused before the model loads, naming the template; a JSON Lines row without one is an error row naming the
row, the column and the template. The template texts are part of the run's identity (``rerun.run_fields``):
changing one on resume is refused, naming it.

A template is user code run on rows nobody has read, so it runs under ``budgets``: a template that cannot run
(syntax, an unknown filter, nesting too deep to compile) is refused before the model loads; on a row, loop
iterations, calls, the sizes of strings and lists an operation makes, the rendered text and the render's wall time
are bounded (``BoundedEnvironment``), so a row that passes one (``{% for i in range(100000) %}{% for j in
range(100000) %}`` over a hidden input) is that row's error naming the budget — never a hang or a job killed for
memory. The sandbox alone bounds none of these: it stops a template reaching Python's internals, not working
forever.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from jinja2 import StrictUndefined, TemplateSyntaxError, meta, nodes, pass_context
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.runtime import LoopContext, Undefined
from jinja2.sandbox import SandboxedEnvironment
from jinja2.visitor import NodeTransformer

from dspine_batch.errors import RowError, UsageError
from dspine_batch.requests.budgets import (
    CAUGHT,
    MAX_CALLS,
    MAX_ITEMS,
    MAX_ITERATIONS,
    RENDER_SECONDS,
    OverBudget,
    check_binop,
    check_format,
    check_items,
    check_printf,
    too_big,
)


@dataclass
class _Work:
    """What one render has spent; checked by every loop step, call and output chunk."""

    deadline: float
    iterations: int = 0
    calls: int = 0

    def steps(self, n: int) -> None:
        self.iterations += n
        if self.iterations > MAX_ITERATIONS:
            raise OverBudget(f"more than {MAX_ITERATIONS:,} loop iterations")
        self.in_time()

    def call(self) -> None:
        self.calls += 1
        if self.calls > MAX_CALLS:
            raise OverBudget(f"more than {MAX_CALLS:,} calls")
        if not self.calls & 255:
            self.in_time()

    def in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget(f"rendering took more than {RENDER_SECONDS:g} s")


_WORK: ContextVar[_Work | None] = ContextVar("dspine_batch_template_work", default=None)
_LOOP, _CONCAT = "_dspine_loop", "_dspine_concat"  # the filters every loop and ``~`` are rewritten to pass


def _bounded(items: Iterable[Any]) -> Iterator[Any]:
    """``items``, counted against the render's loop budget 256 at a time (a loop's items are pure values)."""
    work, it = _WORK.get(), iter(items)
    while True:
        block = list(islice(it, 256))
        if work is not None:
            work.steps(len(block))
        yield from block
        if len(block) < 256:
            return


@pass_context  # (never folded into a constant when the template compiles)
def _loop_filter(context: Any, items: Any) -> Any:
    return items if isinstance(items, Undefined) else _bounded(items)  # (an undefined one fails as it did)


@pass_context
def _concat_filter(context: Any, parts: list[Any]) -> str:
    texts = [str(p) for p in parts]
    check_items(sum(map(len, texts)), "a string")
    return "".join(texts)


def _size(v: Any) -> int:
    return len(v) if isinstance(v, str | bytes | list | tuple | dict | set) else 0


def _check_args(what: str, value: Any, args: tuple[Any, ...]) -> None:
    """Arguments of a filter or a string method that would make its result pass the budget (``center(10**9)``,
    ``replace("", text)``, ``join`` with a long separator), refused before it runs."""
    for a in args:
        if isinstance(a, int) and a > MAX_ITEMS:
            raise too_big(a, f"{what}'s argument")
    if what == "replace" and len(args) >= 2 and isinstance(value, str) and isinstance(args[0], str):
        times = len(value) + 1 if not args[0] else value.count(args[0])
        check_items(len(value) + times * len(str(args[1])), "a string")
    elif what == "join" and isinstance(value, str) and args and hasattr(args[0], "__len__"):  # sep.join(items)
        check_items(len(value) * len(args[0]), "a string")
    elif what in ("join", "wordwrap", "indent") and isinstance(value, str | list | tuple):
        sep = args[0] if what == "join" and args else (args[3] if what == "wordwrap" and len(args) > 3 else
                                                        args[0] if what == "indent" and args else "")
        if isinstance(sep, str):
            lines = len(value) if what in ("join", "wordwrap") else str(value).count("\n") + 1
            check_items(lines * len(sep) + _size(value), "a string")


def _guarded(name: str, fn: Any) -> Any:
    """A built-in filter, its arguments checked (``_check_args``) and its call counted."""

    def run(*args: Any, **kwargs: Any) -> Any:
        work = _WORK.get()
        if work is not None:
            work.call()
        ctx = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/env/eval_ctx goes first
        value, rest = (args[ctx], args[ctx + 1:]) if len(args) > ctx else (None, ())
        _check_args(name, value, (*rest, *kwargs.values()))
        if name == "format" and isinstance(value, str):
            check_printf(value)
        return fn(*args, **kwargs)

    run.jinja_pass_arg = getattr(fn, "jinja_pass_arg", None)  # type: ignore[attr-defined]
    return run


class BoundedEnvironment(SandboxedEnvironment):
    """The sandbox with ``budgets``: arithmetic that would make a huge value is refused before it runs
    (``intercepted_binops``), every call is counted and its arguments checked, ``str.format`` widths are checked,
    and (``bound``) every ``for`` loop's items are counted and every ``~`` checked. A render runs inside
    ``render_bounded``, which holds the per-render count and deadline and bounds the rendered text."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        for name in ("center", "indent", "format", "replace", "wordwrap", "join", "slice", "batch", "truncate"):
            self.filters[name] = _guarded(name, self.filters[name])
        self.filters[_LOOP], self.filters[_CONCAT] = _loop_filter, _concat_filter

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        work = _WORK.get()
        if work is not None:
            work.call()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: its items are counted too
            args = (_bounded(args[0]), *args[1:])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str | list):
            _check_args(getattr(__obj, "__name__", ""), owner,
                        args + tuple(a for k, a in kwargs.items() if not k.startswith("_")))
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(owner, list) and len(owner) > MAX_ITEMS:  # grown in place: ``items.extend(items)`` in a loop
            raise too_big(len(owner), "a list")
        return result

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            check_format(fmt)
            return wrapped(*args, **kwargs)

        return checked


class _Bound(NodeTransformer):
    """Every ``for`` loop's items through the counting filter, every ``~`` through the checked join."""

    def visit_For(self, node: nodes.For) -> nodes.Node:  # noqa: N802 (jinja's visitor names)
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:  # noqa: N802
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT, [], [], None, None,
                            lineno=node.lineno)


def render_bounded(compiled: Any, row: Mapping[str, Any]) -> str:
    """``compiled`` rendered for ``row`` within the budgets (``OverBudget`` past one)."""
    work = _Work(time.monotonic() + RENDER_SECONDS)
    token = _WORK.set(work)
    try:  # the chunks taken 64 at a time (counted in C), from the render function itself, not ``generate``
        chunks = compiled.root_render_func(compiled.new_context(row))
        out: list[str] = []
        size = 0
        while True:
            block = list(islice(chunks, 64))
            size += sum(map(len, block))
            if size > MAX_ITEMS:
                raise too_big(size, "a rendered text")
            out += block
            if len(block) < 64:
                return "".join(out)
            work.in_time()
    finally:
        _WORK.reset(token)


_ENV = BoundedEnvironment(undefined=StrictUndefined, keep_trailing_newline=False, autoescape=False)
_UNDEFINED = re.compile(r"^'([^']+)' is undefined$")


@dataclass(frozen=True)
class Template:
    """One compiled template: its text (the identity), how to name it in messages (``label``: the flag and the
    file, if it came from one), and the row's columns it reads (``columns``)."""

    text: str
    label: str
    columns: tuple[str, ...]
    compiled: Any = field(compare=False, repr=False)

    def render(self, row: Mapping[str, Any], file: str, index: int) -> str:
        """The text for one row; a problem is a ``RowError`` naming the row, the column and the template."""
        try:
            return render_bounded(self.compiled, row)
        except OverBudget as e:
            raise RowError(file, index, _first_column(self, row), f"the template {self.label} is over budget on "
                           f"this row: {e}") from e
        except CAUGHT as e:
            raise RowError(file, index, _first_column(self, row), f"the template {self.label} is over budget on "
                           f"this row ({type(e).__name__}: {str(e)[:120] or 'out of memory'})") from e
        except UndefinedError as e:
            m = _UNDEFINED.match(str(e))
            if m:  # a top-level name: a column this row lacks
                raise RowError(file, index, m.group(1), f"missing (the template {self.label} names it)") from e
            raise RowError(file, index, _first_column(self, row), f"{e} (in the template {self.label})") from e
        except SecurityError as e:
            raise RowError(file, index, None, f"the template {self.label} tried something the sandbox forbids "
                           f"({e})") from e
        except Exception as e:  # a filter or an operator on the row's values: the row's data broke the template
            raise RowError(file, index, _first_column(self, row),
                           f"cannot render the template {self.label} ({type(e).__name__}: {str(e)[:200]})") from e


def _first_column(t: Template, row: Mapping[str, Any]) -> str | None:
    return t.columns[0] if len(t.columns) == 1 else None


def compile_template(value: str, flag: str) -> Template:
    """A template from an option's value: a file's text when the value names an existing file, else the text
    itself. A syntax error is a ``UsageError`` naming the flag (and file) and the line."""
    label = flag
    text = value
    if "\n" not in value and "{" not in value and os.path.isfile(value):
        label = f"{flag} {value}"
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{label}: {getattr(e, 'strerror', None) or e}") from e
    if not text.strip():
        raise UsageError(f"{label}: the template is empty")
    try:
        ast = _ENV.parse(text)
        names = sorted(meta.find_undeclared_variables(ast) - set(_ENV.globals))
        bound = _Bound().visit(ast)
        bound.set_environment(_ENV)
        compiled = _ENV.from_string(bound)
    except TemplateSyntaxError as e:
        raise UsageError(f"{label}: not a valid template: {e.message} (line {e.lineno})") from e
    except (RecursionError, MemoryError, SyntaxError) as e:  # the parser or Python's compiler gave up on its depth
        raise UsageError(f"{label}: not a valid template: nested too deeply to compile ({type(e).__name__})") from e
    return Template(text, label, tuple(names), compiled)


@dataclass(frozen=True)
class PromptTemplates:
    """The job's templates: the user turn (``prompt``) and, optionally, the system turn."""

    prompt: Template
    system: Template | None = None

    @property
    def columns(self) -> tuple[str, ...]:
        names = self.prompt.columns + (self.system.columns if self.system else ())
        return tuple(dict.fromkeys(names))

    def identity(self) -> dict[str, str | None]:
        return {"prompt": self.prompt.text, "system": self.system.text if self.system else None}

    def label_of(self, column: str) -> str:
        """The template that reads ``column`` (for refusals)."""
        if column in self.prompt.columns or self.system is None:
            return self.prompt.label
        return self.system.label


def job_templates(prompt: str | None, system: str | None) -> PromptTemplates | None:
    """The job's templates from ``--prompt-template`` / ``--system-template`` (None when neither is given)."""
    if not prompt:
        if system:
            raise UsageError("--system-template needs --prompt-template (the user turn)")
        return None
    return PromptTemplates(compile_template(prompt, "--prompt-template"),
                           compile_template(system, "--system-template") if system else None)
