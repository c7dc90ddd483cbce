"""The command line's building blocks, shared by its commands: the option types (``KEY=VALUE``, finite floats,
an OUTDIR or a URL), the decorators that give every option its ``DSPINE_BATCH_<OPTION>`` variable and
``GenerateConfig`` default (one name per option across commands) and put it in a ``generate --help`` section, and
the job file's reading (``--config``: TOML keys checked against the command's options)."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from dataclasses import MISSING
from typing import Any

import click
from click_option_group import GroupedOption, optgroup

from dspine_batch.cli.help import SECTIONS
from dspine_batch.config import GenerateConfig, default, load_toml
from dspine_batch.errors import UsageError

ENV = "DSPINE_BATCH_"


class KeyValue(click.ParamType):
    """``KEY=VALUE`` -> ``(key, value)``, checked once where it is parsed."""

    name = "KEY=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        key, sep, val = str(value).partition("=")
        if not sep or not key.strip():
            self.fail(f"{value!r}: expected KEY=VALUE", param, ctx)
        return key.strip(), val


class FiniteFloatRange(click.FloatRange):
    """A float range that also refuses nan and inf (which compare false with every bound)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)


class OutdirOrUrl(click.ParamType):
    """An existing local directory, or a URL (``s3://bucket/prefix``): checked by the command that reads it."""

    name = "OUTDIR"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from dspine_batch.storage.urls import is_url

        if is_url(str(value)):
            return str(value)
        return click.Path(exists=True, file_okay=False).convert(value, param, ctx)


def _set_storage_options(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    from dspine_batch.storage.fs import set_options
    from dspine_batch.storage.urls import parse_options

    set_options(parse_options(list(value)))


def storage_option(f: Callable | None = None, grouped: bool = False) -> Callable:
    """``--storage-option KEY=VALUE`` (repeatable): settings of the fsspec filesystem behind URLs (s3fs:
    ``endpoint_url``, ``profile``, ``anon``, ``client_kwargs.region_name``, ...; adlfs: ``account_name``,
    ``account_key``, ``connection_string``, ``sas_token``, ...); also
    ``DSPINE_BATCH_STORAGE_OPTIONS`` (JSON or ``k=v,k=v``). Never printed or written anywhere. ``@storage_option``
    on a command, ``@storage_option(grouped=True)`` inside a help section (``section``)."""
    if f is None:
        return lambda g: storage_option(g, grouped)
    option = optgroup.option if grouped else click.option
    return option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE",
                  expose_value=False, callback=_set_storage_options, is_eager=True,
                  help="A setting of the store behind URL inputs/outputs, e.g. endpoint_url=https://... or "
                       "profile=NAME (repeatable; env DSPINE_BATCH_STORAGE_OPTIONS). Credentials come from "
                       "the usual places (AWS_* env, profile, instance role; AZURE_STORAGE_CONNECTION_STRING "
                       "or AZURE_STORAGE_ACCOUNT_NAME/_KEY).")(f)


def _env_kwargs(decls: tuple[str, ...], kw: dict[str, Any]) -> dict[str, Any]:
    """An option's settings with a DSPINE_BATCH_<OPTION> env var (shown in --help) and, when its setting has one,
    the default of ``GenerateConfig`` (so defaults have one copy)."""
    name = next(d for d in decls if d.startswith("--")).lstrip("-").split("/")[0].replace("-", "_")
    kw.setdefault("envvar", ENV + name.upper())
    kw.setdefault("show_envvar", True)
    value = default(name) if name in GenerateConfig.__dataclass_fields__ else MISSING
    if value is not MISSING and "default" not in kw and not kw.get("multiple"):
        kw["default"] = value
        kw.setdefault("show_default", value is not None)
    return kw


def env_option(*decls: str, **kw: Any) -> Callable:
    """A click option with its environment variable and ``GenerateConfig`` default (``_env_kwargs``)."""
    return click.option(*decls, **_env_kwargs(decls, kw))


def section(title: str) -> Callable:
    """A section of ``generate --help`` (``help.SECTIONS``): the ``grouped`` options below it belong to it."""
    return optgroup.group(title, help=dict(SECTIONS)[title])


class SectionOption(GroupedOption):
    """An option of a help section whose environment variable is named in its errors (where a bad value may come
    from it) but not on its help line: the command's help says the rule once, ``DSPINE_BATCH_<OPTION>``."""

    def get_error_hint(self, ctx: click.Context) -> str:
        hint = super().get_error_hint(ctx)
        return hint if self.show_envvar or not self.envvar else f"{hint} (env var: '{self.envvar}')"


def grouped(*decls: str, **kw: Any) -> Callable:
    """``env_option`` inside the ``section`` above it (its variable named in errors, not on its help line)."""
    kw.setdefault("show_envvar", False)
    return optgroup.option(*decls, cls=SectionOption, **_env_kwargs(decls, kw))


def load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value:
        data = load_toml(value)
        if "stages" in data:  # [[stages]]: a job of several stages (dspine_batch.stages)
            ctx.meta["stages"] = data.pop("stages")
        template = data.pop("template", None)  # `template = "..."`, or a table {system = "...", user = "..."}
        if isinstance(template, dict):
            data["prompt_template"], data["system_template"] = template.get("user"), template.get("system")
        elif template is not None:
            data["prompt_template"] = template
        known = sorted({p.name for p in ctx.command.params if p.name and p.name not in ("config", "output_dir")} |
                       {"inputs", "input", "output", "engine_args"})
        for key in data:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise UsageError(f"--config {value}: unknown key {key!r}{hint}; the keys are: {', '.join(known)}")
        if isinstance(data.get("engine_args"), dict):
            data["engine_arg"] = [f"{k}={v}" for k, v in data.pop("engine_args").items()]
        for key in ("keep_columns", "stop", "choice"):
            if isinstance(data.get(key), str):
                data[key] = [data[key]]
        for key in ("response_format", "chat_template_kwargs", "tools", "json_schema"):  # tables: inline JSON
            if isinstance(data.get(key), dict | list):
                data[key] = json.dumps(data[key])
        if isinstance(data.get("logit_bias"), dict):
            data["logit_bias"] = [f"{k}={v}" for k, v in data["logit_bias"].items()]
        if "inputs" in data or "input" in data:
            ctx.meta["config_inputs"] = data.pop("inputs", None) or data.pop("input")
        if "output" in data:
            data["output_dir"] = data.pop("output")
        ctx.default_map = {**(ctx.default_map or {}), **data}
    return value
