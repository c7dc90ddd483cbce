"""Help that guides: ``generate --help`` in sections (every option in exactly one, in ``cli.help.SECTIONS``'s order),
the ``--engine-arg`` keys as a table naming every key the engines accept, and the error for an input without a
prompt column naming the three options that say where the prompt is."""

from __future__ import annotations

import re

import click
from click.testing import CliRunner
from helpers import run_cli, write_jsonl

from dspine_batch.cli import cli
from dspine_batch.cli.help import ENGINE_ARGS, SECTIONS


def _sections(text: str) -> dict[str, list[str]]:
    """The rendered help's sections: title -> the option flags listed under it (``  Title:`` at two spaces, options
    at four)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^  ([A-Z][\w ]+):", line):
            current = m.group(1)
            out[current] = []
        elif current and (m := re.match(r"^    (-[\w-]+(?:, --[\w-]+)?(?: / --[\w-]+)?)", line)):
            out[current] += re.findall(r"--?[\w-]+", m.group(1))
        elif line and not line.startswith(" "):
            current = None
    return out


def test_every_option_is_in_exactly_one_section_in_order():
    cmd = cli.commands["generate"]
    text = CliRunner().invoke(cli, ["generate", "--help"], terminal_width=120).output
    found = _sections(text)
    assert list(found)[: len(SECTIONS)] == [t for t, _ in SECTIONS]  # the sections, in order, before anything else
    options = [p for p in cmd.params if isinstance(p, click.Option) and p.opts and p.name != "help"]
    assert len(options) > 40
    for p in options:
        flags = [*p.opts, *p.secondary_opts]
        where = [title for title, listed in found.items() if any(f in listed for f in flags)]
        assert len(where) == 1, f"{flags} listed in {where or 'no section'}"
        assert found[where[0]].count(p.opts[-1]) == 1
        assert where[0] in dict(SECTIONS)
    # the first things a newcomer needs, first
    assert found["Inputs"][:1] == ["--config"] and found["Speculation and engine"][:3] == ["-m", "--model", "--draft"]


def test_engine_args_are_a_table_of_every_key_the_engines_take():
    from dspine_batch.engines.reference import ARGS
    from dspine_batch.engines.sglang.args import ADAPTER_KEYS

    keys = {k for k, *_ in ENGINE_ARGS}
    assert set(ARGS) <= keys and set(ADAPTER_KEYS) <= keys
    text = CliRunner().invoke(cli, ["generate", "--help"], terminal_width=120).output
    table = text[text.index("Engine arguments"):]
    assert re.search(r"^\s+key\s+engine\s+default\s+what it does$", table, re.M)
    for key, engine, default, _ in ENGINE_ARGS:
        assert re.search(rf"^\s+{key}\s+{engine}\s+{re.escape(default)}\s+\S", table, re.M), key


def test_no_prompt_column_names_the_options_that_say_where_the_prompt_is(tmp_path, capsys):
    src = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "question": "Why is the sky blue?"}])
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q.jsonl" in err[0]
    for option in ("--prompt-column", "--messages-column", "--prompt-template"):
        assert option in err[0]
    assert "--prompt-template 'Answer: {{ id }}'" in err[0] or "{{ question }}" in err[0]
    # a named column that is missing is still that flag's own error
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), "--prompt-column", "q"]) == 2
    assert "no column 'q' for --prompt-column" in capsys.readouterr().err
