"""The one recovery: what a crash left in an OUTDIR, settled in one order before anything reads it.

Every command that opens an OUTDIR to read or write its rows — ``generate`` (every stage, before
``--retry-errors`` and before the "nothing left" check), ``finalize``, ``status``, ``report``, ``export`` and
compaction — calls ``recover`` first, the way a database rolls its journal forward or back at open before any
reader or writer sees it. The order matters, each step relying on the one before:

1. an interrupted ``finalize --compact`` (its journal): finished when the merged part is committed, else dropped;
   it reads commit records, so it goes before anything moves them;
2. an interrupted ``--retry-errors`` take-out (each shard's journal): rolled forward when the part's new record
   is the one in place, else back; it must go before the staging sweep, which would otherwise delete the
   replacement part a committed swap points at;
3. interrupted publishes finished (a committed part not yet visible to readers) and orphan uploads swept.

Writers (``generate``, ``finalize``, compaction) run it holding the shard's lock or lease. Readers (``status``,
``report``, ``export``) run it only for shards no live worker holds (``recover_free``): a running worker settled its
own shard at its start, and nothing of a live shard is touched from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dspine_batch.errors import BatchError
from dspine_batch.outdir.layout import shard_tag
from dspine_batch.outdir.manifest import stage_names
from dspine_batch.outdir.output import Output, open_output


@dataclass
class Recovered:
    """What ``recover`` did: uncommitted uploads discarded, and a line for each journal it settled."""

    discarded: int = 0
    said: list[str] = field(default_factory=list)


def recover(out: Output, tags: list[str], report: Callable[[str], None] | None = None) -> Recovered:
    """Settle what a crash left for the shards ``tags`` (their locks held), in the module's order."""
    done = Recovered()
    out.recover()
    for tag in tags:
        if (said := out.recover_retry(tag)) is not None:
            done.said.append(f"--retry-errors interrupted: {said}")
    for tag in tags:
        done.discarded += out.remove_staging(tag)
    for line in done.said:
        if report is not None:
            report(line)
    return done


def every_shard(out: Output) -> list[str]:
    """The shard tags of an OUTDIR's run (from its manifest; one shard when it has none yet)."""
    manifest = out.read_manifest() or {}
    n = int(manifest.get("num_shards", 1) or 1)
    return [shard_tag(i, n) for i in range(n)]


def recover_free(out: Output, report: Callable[[str], None] | None = None) -> list[str]:
    """For a command that only reads: ``recover`` each shard no live worker holds (its lock or lease taken for the
    instant, released after; a lease not yet expired counts as held, so this never waits one out); returns the
    shards left alone."""
    held = {h.removeprefix("lock-").removeprefix("lease-") for h in out.held_locks()}
    busy = []
    for tag in every_shard(out):
        if tag in held:
            busy.append(tag)
            continue
        lock = out.lock(tag)
        try:
            lock.acquire()
        except BatchError:  # taken meanwhile
            busy.append(tag)
            continue
        try:
            recover(out, [tag], report)
        finally:
            lock.release()
    return busy


def recover_for_reading(outdir: str, report: Callable[[str], None] | None = None) -> None:
    """``status``, ``report``, ``export``: every stage's output (or the one output) settled before it is read, where
    no live worker holds a shard; an OUTDIR without a run is left as it is."""
    names = stage_names(outdir)
    for path in [f"{outdir.rstrip('/')}/{n}" for n in names] if names else [outdir]:
        out = open_output(path)
        if out.read_manifest() is not None:
            recover_free(out, report)
