"""Where things live in an OUTDIR, the same on a local disk and under an object-store prefix.

Readers glob ``OUTDIR/*.parquet`` and see committed parts only, each exactly once; everything else is ours:
  ``_manifest.json``                  the run's identity, created once (first shard wins, the others check it)
  ``train-<shard>-<seq>.parquet``     a published part (named like Hub shards, so ``datasets`` matches them)
  ``_dspine/staging/part-<X>.<token>``  a part's bytes before its publish, under a unique name
  ``_dspine/keys/commit-<X>.json``    its **commit record**: rows, outputs, bytes, crc32, the token, the staged
                                      name and the row-key hashes (what a resume loads instead of row ids)
  ``_dspine/state-<shard>.json``      advisory progress (``status``)
  ``_dspine/lock-<shard>``            a local shard's ``flock``; ``_dspine/lease-<shard>.json`` a store's lease
  ``_dspine/compact.json``, ``_dspine/supersede-<shard>.json``  the journals of multi-step changes
  ``_dspine/damaged/``                parts moved aside by a repair (never deleted by us)
  ``_SUCCESS``                        written by a finished run or ``finalize``

Outputs written before this layout (a local disk only) also hold ``.<part>.inprogress`` staging files in the top
directory and ``_dspine/keys/keys-<X>.npy`` key files; ``legacy`` reads and sweeps them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Parts are named like Hub shards ("train-00000-of-00001-000012.parquet"): `datasets.load_dataset("parquet",
# data_dir=OUTDIR)` then matches them by its split pattern and skips _manifest.json, _SUCCESS and _dspine/
# (it does not ignore "_" names itself). pyarrow, pandas, polars and duckdb only need the ".parquet" suffix.
PART_PREFIX = "train-"
PART_RE = re.compile(r"^train-(\d{5}-of-\d{5})-(\d{6})\.parquet$")
STATE = "_dspine"
STAGING = f"{STATE}/staging"
KEYS = f"{STATE}/keys"
DAMAGED = f"{STATE}/damaged"
MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
CLAIM_SPACES = ("dedup", "minhash")  # ``stages.keylog``'s folders under STATE: wiped with the run
# what may be in an OUTDIR's top folder besides parts ("." names: a crash's temp and legacy staging files)
OUTPUT_NAMES = re.compile(r"^(train-.*\.parquet|\..*\.inprogress|\..*\.tmp|_manifest\.json|_dspine|_SUCCESS|"
                          r"_report\.json)$")


def shard_tag(i: int, n: int) -> str:
    """Shard ``i`` of ``n``: ``00003-of-00008``."""
    return f"{i:05d}-of-{n:05d}"


def part_name(shard_tag: str, seq: int) -> str:
    return f"{PART_PREFIX}{shard_tag}-{seq:06d}.parquet"


def stem(name: str) -> str:
    """``train-X.parquet`` -> ``X``."""
    return name.removeprefix(PART_PREFIX).removesuffix(".parquet")


def record_rel(name: str) -> str:
    """A part's commit record: ``_dspine/keys/commit-X.json``."""
    return f"{KEYS}/commit-{stem(name)}.json"


def record_part(record_file: str) -> str | None:
    """``commit-X.json`` -> ``train-X.parquet`` (None for any other file of the keys folder)."""
    if not (record_file.startswith("commit-") and record_file.endswith(".json")):
        return None
    return PART_PREFIX + record_file.removeprefix("commit-").removesuffix(".json") + ".parquet"


def staged_rel(name: str, token: str) -> str:
    """A part's bytes before its publish: ``_dspine/staging/part-X.<token>`` (unique per attempt; neither "train"
    nor ".parquet" in it: ``datasets``' split patterns search sub-folders, ``_dspine/`` included)."""
    return f"{STAGING}/part-{stem(name)}.{token}"


def staged_part(staged: str) -> tuple[str | None, str]:
    """(the part, the token) of a name in the staging folder; also reads the names an older version staged under
    (``train-X.parquet.<token>``). The part is None for anything else."""
    head, _, token = staged.rpartition(".")
    name = PART_PREFIX + head.removeprefix("part-") + ".parquet" if head.startswith("part-") else head
    return (name if PART_RE.match(name) else None), token


def state_rel(tag: str) -> str:
    return f"{STATE}/state-{tag}.json"


def shard_of(name: str) -> str | None:
    """The shard tag of a part name, None when ``name`` is not a part."""
    m = PART_RE.match(name)
    return m.group(1) if m else None


def seq_of(name: str) -> int:
    m = PART_RE.match(name)
    assert m is not None, name
    return int(m.group(2))


@dataclass
class Part:
    """A published part: ``path`` is a local path, or a URL on an object store (read it with ``arrow_path``)."""

    path: str
    shard: str
    seq: int


def parts_of(names: list[str] | dict[str, object], where: str, shard: str | None = None) -> list[Part]:
    """The parts among ``names`` (a listing of ``where``), of one shard when ``shard``, in (shard, seq) order."""
    out = []
    for name in names:
        m = PART_RE.match(name)
        if m and (shard is None or m.group(1) == shard):
            out.append(Part(f"{where}/{name}", m.group(1), int(m.group(2))))
    return sorted(out, key=lambda p: (p.shard, p.seq))
