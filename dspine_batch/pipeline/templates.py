"""Prompts built from a row's columns: ``--prompt-template`` (the user turn) and ``--system-template``.

Jinja2 in its sandbox (``SandboxedEnvironment``: no attribute access to Python internals, no calls to unsafe
callables) with ``StrictUndefined``: a name the template uses that the row lacks is an error, never an empty
string silently pasted into a prompt. Nested values read as attributes or items (``{{ judge.score }}``,
``{{ doc["title"] }}``: a Parquet struct or a JSON object arrives as a dict). The columns a template reads are
found once from its syntax tree (``jinja2.meta``), so the pipeline reads only those and an input whose schema lacks
one is refused before the model loads, naming the template; a JSON Lines row without one is an error row naming the
row, the column and the template. The template texts are part of the run's identity (``rerun.run_fields``):
changing one on resume is refused, naming it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2 import StrictUndefined, TemplateSyntaxError, meta
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.sandbox import SandboxedEnvironment

from dspine_batch.errors import RowError, UsageError

_ENV = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=False, autoescape=False)
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
            return self.compiled.render(row)
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
    except TemplateSyntaxError as e:
        raise UsageError(f"{label}: not a valid template: {e.message} (line {e.lineno})") from e
    names = sorted(meta.find_undeclared_variables(ast) - set(_ENV.globals))
    return Template(text, label, tuple(names), _ENV.from_string(text))


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
