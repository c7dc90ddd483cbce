"""Dedup across shards through the key log (``stages.keylog``, issue 56): shards of one job run at once, each in its
own process, each killed -9 at its own random moment, then the same commands again until every shard is done, on a
local disk, moto's S3 and Azurite. Every input row is in the output exactly once; no two kept rows share a key (or
are near duplicates: one row per group kept); the kept keys (groups) are those of one unsharded run; the stage's
log holds at most one entry per committed part (and one per killed attempt), not one object per kept row."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from helpers import near_job, read_output, run_cli, spawn, write_jsonl
from test_objstore_crash import _wait
from test_objstore_generate import read_s3_output

ROWS, KEYS, GROUPS = 240, 60, 30
_VOCAB = [f"w{i}" for i in range(400)]


def _inputs(tmp_path: Path, dedup: str) -> Path:
    """Exact: ``ROWS`` rows over ``KEYS`` texts (case and spacing vary: the same key). Minhash: ``GROUPS`` groups of
    near duplicates (a text, its upper-case variant with punctuation, the same with its last word changed), each
    text 30 words of a 400-word vocabulary (no two groups near), rows shuffled."""
    rng = random.Random(56)
    if dedup == "exact":
        texts = [" ".join(rng.sample(_VOCAB, 6)) for _ in range(KEYS)]
        rows = [{"doc_id": f"k{i % KEYS}-{i}", "text": (texts[i % KEYS].upper() if i % 3 else texts[i % KEYS])
                 + " " * (i % 2)} for i in range(ROWS)]
    else:
        rows = []
        for g in range(GROUPS):
            words = rng.sample(_VOCAB, 30)
            base = " ".join(words)
            rows += [{"doc_id": f"g{g}-a", "text": base}, {"doc_id": f"g{g}-b", "text": base.upper() + "!"},
                     {"doc_id": f"g{g}-c", "text": " ".join([*words[:-1], "today"])}]
    rng.shuffle(rows)
    return write_jsonl(tmp_path / f"{dedup}.jsonl", rows)


def _job(tmp_path: Path, src: Path, out: str, dedup: str, extra: str = "") -> str:
    # a minhash shard holds 22-45 rows: parts of 6 rows, so that a shard killed after the first part still has some
    # left (parts of 20 came at a shard's end, and four shards starting at once all finished before their kills)
    return near_job(tmp_path, src, out, f"commit-seconds = 5\n{extra}", dedup,
                    commit_rows=20 if dedup == "exact" else 6)


class _Local:
    def __init__(self, tmp_path: Path):
        self.out, self.env = str(tmp_path / "out"), {}

    def rows(self) -> list[dict]:
        return read_output(Path(self.out) / "notes")

    def names(self, space: str) -> list[str]:
        """The space's names, less the disk store's own temp files (``.<name>.<pid>.<token>.tmp``: a create-only
        write killed -9 before its link leaves one; no reader lists it as an entry)."""
        d = Path(self.out) / "notes" / "_dspine" / space
        return [p.name for p in d.glob("*") if not p.name.endswith(".tmp")] if d.exists() else []

    def parts(self) -> int:
        return len(list((Path(self.out) / "notes").glob("*.parquet")))


class _Remote:
    def __init__(self, fs, url: str, env: dict[str, str]):
        self.fs, self.url, self.env = fs, url, env
        self.prefix = url.split("://", 1)[1]

    def rows(self) -> list[dict]:
        self.fs.invalidate_cache()
        return read_s3_output(self.fs, f"{self.prefix}/notes")

    def names(self, space: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            return [p.rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.prefix}/notes/_dspine/{space}", refresh=True)]
        except FileNotFoundError:
            return []

    def parts(self) -> int:
        self.fs.invalidate_cache()
        try:
            return len(self.fs.glob(f"{self.prefix}/notes/*.parquet"))
        except FileNotFoundError:  # the folder not there yet (adlfs)
            return 0


def _store(kind: str, tmp_path: Path, request) -> _Local | _Remote:
    if kind == "local":
        return _Local(tmp_path)
    if kind == "s3":
        bucket = request.getfixturevalue("bucket")
        return _Remote(request.getfixturevalue("s3"), f"s3://{bucket}/out", request.getfixturevalue("s3env"))
    container = request.getfixturevalue("container")
    return _Remote(request.getfixturevalue("az"), f"az://{container}/out", request.getfixturevalue("azenv"))


def _group(row_id: str) -> str:
    return row_id.split("-")[0]


_SLOW = pytest.mark.slow  # ~25 s a cell: three in the default suite (each store, 2 and 4 shards, both kinds)


@pytest.mark.parametrize(("kind", "dedup", "shards"), [
    ("local", "exact", 4), pytest.param("local", "minhash", 2, marks=_SLOW),
    pytest.param("s3", "exact", 2, marks=_SLOW), ("s3", "minhash", 4),
    ("az", "exact", 2), pytest.param("az", "minhash", 2, marks=_SLOW)])
def test_sharded_dedup_killed_in_every_shard_keeps_what_one_run_keeps(tmp_path, request, kind, dedup, shards):
    src = _inputs(tmp_path, dedup)
    ref = tmp_path / "ref"
    assert run_cli(["generate", "--config", _job(tmp_path, src, str(ref), dedup)]) == 0
    want = read_output(ref / "notes")
    store = _store(kind, tmp_path, request)
    job = _job(tmp_path, src, store.url if isinstance(store, _Remote) else store.out, dedup,
               'engine-args = {latency = "0.05"}\nmax-in-flight = 8\n')
    rng = random.Random(f"{kind}-{dedup}-{shards}")
    procs = [spawn(["generate", "--config", job, "--shard", f"{i}/{shards}"], **store.env) for i in range(shards)]
    _wait(lambda: store.parts() > 0 or all(p.poll() is not None for p in procs), "a first committed part")
    kills = 0
    for p in procs:  # each shard killed at its own moment
        time.sleep(rng.uniform(0.0, 0.6))
        if p.poll() is None:
            p.kill()
            kills += 1
        _, err = p.communicate()
        assert p.returncode in (0, -signal.SIGKILL), err.decode()
    assert kills >= 1
    for _ in range(3):  # the same commands again, every shard at once, until each is done
        procs = [spawn(["generate", "--config", job, "--shard", f"{i}/{shards}"], **store.env)
                 for i in range(shards)]
        codes = []
        for p in procs:
            _, err = p.communicate(timeout=300)
            codes.append(p.returncode)
            assert p.returncode in (0, 75), err.decode()
        if codes == [0] * shards:
            break
    assert codes == [0] * shards
    rows = store.rows()
    assert sorted(r["row_id"] for r in rows) == sorted(r["row_id"] for r in want)  # each row exactly once
    kept = [r for r in rows if r["kept"]]
    if dedup == "exact":
        keys = [r["dedup_key"] for r in kept]
        assert len(keys) == len(set(keys)) == KEYS  # no two kept rows share a key
        assert set(keys) == {r["dedup_key"] for r in want if r["kept"]}  # the keys one unsharded run keeps
    else:
        groups = [_group(r["row_id"]) for r in kept]
        assert len(groups) == len(set(groups)) == GROUPS  # one row of each group of near duplicates
        assert set(groups) == {_group(r["row_id"]) for r in want if r["kept"]}
    assert {r["dropped_by"] for r in rows if not r["kept"]} == {f"dedup {dedup} on text"}
    space = "dedup" if dedup == "exact" else "minhash"
    entries = [n for n in store.names(space) if n.startswith("log-")]
    assert entries == store.names(space)  # nothing but the log: no object per kept row (nor per band)
    assert 0 < len(entries) <= store.parts() + kills  # one entry a committed part, one more a killed attempt
    if isinstance(store, _Local):
        assert run_cli(["finalize", store.out]) == 0  # the audit: no kept key shared across shards


def test_a_shard_killed_between_its_log_entry_and_its_commit_takes_its_keys_back(tmp_path):
    """kill -9 at the one step the key log adds (``tests/killpoint_cli.py``: right after shard 0 created its second
    entry, before that part's commit record): shard 1, run next, takes the dead entry's keys as held and drops its
    rows with them; shard 0's rerun reads its own dead entry as holding nothing, so it keeps those keys itself — the
    job keeps each key once, and the keys one unsharded run keeps (none lost to the dead entry)."""
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    src = _inputs(tmp_path, "exact")
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli(["generate", "--config", _job(tmp_path, src, str(ref), "exact")]) == 0
    job = _job(tmp_path, src, str(out), "exact")
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "killpoint_cli.py"), "generate", "--config", job,
                             "--shard", "0/2"], env=subprocess_env(DSPINE_TEST_KILL_AT="after:link:log-*:2"),
                            capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    entries = sorted((out / "notes" / "_dspine" / "dedup").glob("log-*"))
    assert len(entries) == 2 and len(list((out / "notes").glob("*.parquet"))) == 1  # the second part never committed
    for shard in (1, 0):
        assert run_cli(["generate", "--config", job, "--shard", f"{shard}/2"]) == 0
    rows = read_output(out / "notes")
    assert sorted(r["row_id"] for r in rows) == sorted(r["row_id"] for r in read_output(ref / "notes"))
    keys = [r["dedup_key"] for r in rows if r["kept"]]
    assert len(keys) == len(set(keys)) == KEYS
    assert set(keys) == {r["dedup_key"] for r in read_output(ref / "notes") if r["kept"]}
    assert run_cli(["finalize", str(out)]) == 0
