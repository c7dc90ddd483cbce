"""How many input rows a job has, when that is known or cheap to know: for the progress bar's total and time left,
the free-space estimate, and ``status``'s remaining rows.

``exact_rows`` reads metadata only (Parquet footers, Arrow stream headers, a local HF dataset's split info), so a
start pays nothing for it. JSON Lines has no row count short of reading the file; during a run the progress
estimates it from the bytes read so far (``ReadPosition``), and ``status``, which is asked once, counts the lines
(``count_rows``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dspine_batch.inputs.sources import InputFile, RowBatch, parquet_file
from dspine_batch.storage.fs import size as store_size


def exact_rows(files: list[InputFile], limit: int | None) -> int | None:
    """Input rows from metadata alone; None when one input is JSON Lines (or unreadable: only a hint)."""
    total = 0
    try:
        for inp in files:
            n = _metadata_rows(inp)
            if n is None:
                return None
            total += n
    except Exception:  # only a hint: a damaged input is reported by the reader, in its own words
        return None
    return min(total, limit) if limit is not None else total


def count_rows(files: list[InputFile], limit: int | None) -> int | None:
    """``exact_rows``, counting the non-blank lines of JSON Lines inputs (the rows a run reads from them)."""
    from dspine_batch.inputs.sources import _open_text_stream  # the reader's own decompression

    total = 0
    try:
        for inp in files:
            n = _metadata_rows(inp)
            if n is None:
                with _open_text_stream(inp.path) as f:
                    n = sum(1 for line in f if line.strip())
            total += n
            if limit is not None and total >= limit:
                return limit
    except Exception:
        return None
    return total


def _metadata_rows(inp: InputFile) -> int | None:
    import pyarrow as pa

    if inp.kind == "parquet":
        return parquet_file(inp.path).metadata.num_rows  # a URL too: the footer only, by ranged reads
    if inp.kind == "arrow":
        n = 0
        for path in inp.arrow_files:
            with pa.memory_map(path) as src:
                n += sum(b.num_rows for b in pa.ipc.open_stream(src))
        return n
    if inp.kind == "hf":
        import datasets

        info = datasets.load_dataset_builder(inp.path).info
        split = (info.splits or {}).get(inp.split)
        return split.num_examples if split is not None and split.num_examples else None
    return None


@dataclass
class ReadPosition:
    """Bytes of the inputs read so far (``RowBatch.consumed`` of the file being read, plus every file before it),
    and what share of all input bytes that is: how the progress estimates a JSON Lines job's total rows."""

    sizes: dict[str, int] = field(default_factory=dict)  # input name -> bytes on disk
    before: int = 0  # bytes of the inputs finished
    current: str | None = None
    consumed: int = 0

    @classmethod
    def of(cls, files: Iterable[InputFile]) -> ReadPosition:
        return cls({f.name: sum(store_size(p) for p in f.content_files()) for f in files})  # URLs too

    def see(self, batch: RowBatch) -> None:
        name = batch.file.name
        if name != self.current:
            if self.current is not None:
                self.before += self.sizes.get(self.current, 0)
            self.current, self.consumed = name, 0
        consumed = getattr(batch, "consumed", None)
        if consumed is not None:
            self.consumed = consumed

    def share(self) -> float | None:
        total = sum(self.sizes.values())
        if not total or self.current is None:
            return None
        return min(1.0, (self.before + self.consumed) / total)
