"""Credentials by key name (issue 50, review item 10): an empty-user URL password, s3fs's ``key``/``secret``/
``token``, ``password=``, ``api_key``, Azure SAS and account keys are redacted in every line we print, and
``--engine-arg api_key=...`` never reaches ``_manifest.json`` (config and fingerprint fields) or the parts'
metadata in clear. A credential is not part of the run's identity: a rotated key resumes the same run."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.errors import UsageError
from dspine_batch.storage.urls import redact

SECRET = "sk-live-Z9q8w7e6r5t4"


@pytest.mark.parametrize("text", [
    f"s3://:{SECRET}@bucket/x",  # an empty user
    f"S3FileSystem(key='AKIAEXAMPLE', secret='{SECRET}', token='tok{SECRET}')",
    f"--storage-option secret={SECRET}",
    f"{{'key': 'AKIA', 'secret': '{SECRET}'}}",
    f"connect failed: password={SECRET} user=bob",
    f'{{"api_key": "{SECRET}", "model": "m"}}',
    f"--engine-arg api_key={SECRET}",
    f"server_flags='--api-key {SECRET} --port 30000'",
    f"sig={SECRET}&sv=2024-08-04&ss=b&srt=sco&sp=rl",  # a SAS token on its own, no '?'
    f"AZURE_STORAGE_ACCOUNT_KEY={SECRET}",
    f"https://{SECRET}@github.com/org/repo",  # a token as the user of an https URL
])
def test_a_credential_named_in_a_line_is_redacted(text):
    harmless = " | max_tokens=5 bos_token=<s> monkey=3 unexpected token: '}' abfs://container@account.dfs.x/d"
    out = redact(text + harmless)
    assert SECRET not in out and "***" in out and out.endswith(harmless), out


def _loader_taking_a_key(seen: list[str]):
    """An engine reached with an API key (as a served model is): the key is an engine argument, and the engine's
    identity holds its server arguments (as SGLang's does)."""

    def load(model: str, draft: str, engine_args: dict[str, str]) -> ScriptedEngine:
        args = dict(engine_args)
        key = args.pop("api_key")
        seen.append(key)
        if key == "bad":
            raise UsageError(f"the server refused api_key={key}{SECRET} (401)")
        engine = ScriptedEngine.from_args(args)
        ident = engine.identity() | {"server_args": {"api_key": key, "context_length": 4096}}
        engine.identity = lambda: ident  # type: ignore[method-assign]
        return engine

    return load


def test_an_api_key_engine_arg_is_never_written_and_a_rotated_key_resumes(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(4))
    out = tmp_path / "out"
    seen: list[str] = []
    load = _loader_taking_a_key(seen)
    assert run_cli(["generate", str(src), "-o", str(out), "--engine-arg", f"api_key={SECRET}"], loader=load) == 0
    assert seen == [SECRET]
    for path in [out / "_manifest.json", *Path(out).rglob("*.parquet"), *Path(out).rglob("*.json")]:
        assert SECRET.encode() not in path.read_bytes(), path
    meta = pq.read_schema(next(Path(out).rglob("*.parquet"))).metadata
    assert b"<redacted>" in meta[b"dspine_batch.run.fingerprint"]
    assert len(read_output(out)) == 4
    capsys.readouterr()
    # the same run with a rotated key: nothing left to do (the key is not part of the identity)
    assert run_cli(["generate", str(src), "-o", str(out), "--engine-arg", "api_key=rotated-key"], loader=load) == 0
    assert "holds a different run" not in capsys.readouterr().err
    # an error line quoting the key is redacted
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "o2"), "--engine-arg", "api_key=bad"],
                   loader=load) == 2
    err = capsys.readouterr().err
    assert "refused api_key=***" in err and SECRET not in err, err
