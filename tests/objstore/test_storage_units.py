"""The storage package's small rules (issue 39): what is a URL, secrets redacted, ``--storage-option`` parsing,
which OUTDIRs are refused and why, shards from Kubernetes Indexed Jobs and AWS Batch arrays, Slurm job files
with an s3:// OUTDIR. No server needed."""

from __future__ import annotations

import importlib.util

import pytest

from dspine_batch.errors import UsageError
from dspine_batch.run.shard import attempt_from_env, parse_shard
from dspine_batch.storage.fs import need_library, transient
from dspine_batch.storage.objects import check_outdir_url
from dspine_batch.storage.urls import is_url, parse_options, redact, scheme


@pytest.mark.parametrize("text, secret", [
    ("s3://AKIAX:wJalr/KEY@bucket/x", "wJalr"),
    ("error at https://user:hunter2@host/p?a=1", "hunter2"),
    ("s3://b/k?X-Amz-Signature=abc123&X-Amz-Credential=AKIA%2F", "abc123"),
    ("az://c/blob?sv=2024&sig=SIGNATUREzz&se=2026", "SIGNATUREzz"),
    ("hf://datasets/x?token=hf_abcdef", "hf_abcdef"),
])
def test_redact_hides_passwords_and_signed_query_values(text, secret):
    out = redact(text)
    assert secret not in out and "***" in out


def test_redact_leaves_plain_text_and_paths_alone():
    for s in ("/data/out", "s3://bucket/out/2026-12-05", "row 3: field 'x': bad", "a=b c=d"):
        assert redact(s) == s


def test_url_or_path():
    assert is_url("s3://b/k") and is_url("gs://b") and is_url("hf://datasets/x")
    assert not is_url("/x/y") and not is_url("rel/x") and not is_url("file:///x") and not is_url("C:\\x")
    assert scheme("S3://b") == "s3"


def test_storage_options_flags_over_env_with_nesting_and_json_values():
    opts = parse_options(["endpoint_url=http://127.0.0.1:9", "client_kwargs.region_name=eu-west-1", "anon=false",
                          "config_kwargs.retries={\"max_attempts\": 3}"],
                         env='{"profile": "nightly", "anon": true}')
    assert opts == {"profile": "nightly", "anon": False, "endpoint_url": "http://127.0.0.1:9",
                    "client_kwargs": {"region_name": "eu-west-1"}, "config_kwargs": {"retries": {"max_attempts": 3}}}
    assert parse_options([], env="requester_pays=true,profile=p") == {"requester_pays": True, "profile": "p"}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_options(["novalue"], env="")
    with pytest.raises(UsageError, match="DSPINE_BATCH_STORAGE_OPTIONS"):
        parse_options([], env="{not json")


def test_outdirs_without_create_if_absent_are_refused_saying_why():
    for url, why in (("hf://datasets/me/out", "create-if-absent"), ("https://host/out", "create-if-absent"),
                     ("gs://b/out", "not implemented yet"), ("memory://out", "one process")):
        with pytest.raises(UsageError, match=why) as e:
            check_outdir_url(url)
        assert "cannot be an output directory" in str(e.value)
    check_outdir_url("/local/out")


def test_unknown_scheme_and_missing_library_name_the_extra(monkeypatch):
    with pytest.raises(UsageError, match="unknown URL scheme"):
        need_library("nosuch://x/y")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(UsageError, match=r"dspine-batch\[gcs\]"):
        need_library("gs://bucket/x.parquet")


def test_transient_errors_are_retried_permanent_ones_not():
    assert transient(ConnectionResetError("reset by peer")) and transient(TimeoutError())
    assert transient(OSError("503 Slow Down"))
    assert not transient(PermissionError("403")) and not transient(FileNotFoundError("x"))
    assert not transient(FileExistsError("412")) and not transient(OSError("At least one of the pre-conditions"))


@pytest.mark.parametrize("env, want", [
    ({"JOB_COMPLETION_INDEX": "3", "JOB_COMPLETIONS": "8"}, (3, 8)),
    ({"AWS_BATCH_JOB_ARRAY_INDEX": "0", "AWS_BATCH_JOB_ARRAY_SIZE": "2"}, (0, 2)),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "2"}, (3, 4)),
    ({"SLURM_ARRAY_TASK_ID": "5"}, (0, 1)),  # as before: Slurm without a count is not an array
    ({}, (0, 1)),
])
def test_shard_from_array_jobs(env, want):
    assert parse_shard(None, env) == want
    assert parse_shard("1/2", env) == (1, 2)  # --shard wins


def test_array_index_without_its_count_is_one_line():
    with pytest.raises(UsageError, match="JOB_COMPLETIONS is not"):
        parse_shard(None, {"JOB_COMPLETION_INDEX": "1"})
    with pytest.raises(UsageError, match="AWS_BATCH_JOB_ARRAY_SIZE"):
        parse_shard(None, {"AWS_BATCH_JOB_ARRAY_INDEX": "1"})
    with pytest.raises(UsageError, match="out of range|0 <= I < N"):
        parse_shard(None, {"JOB_COMPLETION_INDEX": "8", "JOB_COMPLETIONS": "8"})


def test_attempt_from_aws_batch():
    assert attempt_from_env({"AWS_BATCH_JOB_ATTEMPT": "3"}) == 2
    assert attempt_from_env({"SLURM_RESTART_COUNT": "1", "AWS_BATCH_JOB_ATTEMPT": "3"}) == 1
    assert attempt_from_env({}) == 0


def test_slurm_job_files_keep_an_s3_outdir(tmp_path):
    from dspine_batch.ops.slurm import render

    job = tmp_path / "job.toml"
    job.write_text('inputs = ["s3://prompts/nightly/*.parquet"]\n[slurm]\nshards = 4\npartition = ""\n'
                   f'workdir = "{tmp_path}"\n')
    r = render(str(job), "s3://results/synth/2026-12-05", {}, None, [])
    assert r.outdir == "s3://results/synth/2026-12-05" and str(tmp_path) in r.log_dir and "s3:" not in r.log_dir
    assert "s3://results/synth/2026-12-05" in r.array_script.read_text()
    assert "finalize s3://results/synth/2026-12-05" in r.finalize_script.read_text()
    assert not (tmp_path / "s3:").exists()
