"""Input discovery and streaming readers: JSONL (.gz/.zst), OpenAI batch JSONL, Parquet, datasets dirs.

Everything is streamed in bounded batches (Parquet by row group, JSONL by lines, Arrow datasets memory
mapped), so memory never depends on input size. Row order is stable across runs: it defines the fallback
row id ``<file>:<row-index>`` and makes resume and sharding reproducible. Per-row problems (bad JSON, bad
UTF-8) are yielded as ``RowError`` values in place of the row, never raised. Problems with a whole file (a
damaged .gz/.zst, a file that is not UTF-8 text at all) are ``UsageError``s raised before any work starts.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from dspine_batch.errors import FatalError, RowError, UsageError
from dspine_batch.storage import fs as store
from dspine_batch.storage.urls import is_url, redact

# an OpenAI batch line's body keys that ask nothing of the model: dropped when the line becomes a row
IGNORED_BODY_KEYS = frozenset({"model", "stream", "stream_options", "user", "metadata", "store", "service_tier"})


BATCH_ROWS = 4096
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".json", ".ndjson.gz", ".ndjson.zst")
UTF8_BOM = b"\xef\xbb\xbf"
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd"}
_NOT_UTF8 = "not valid UTF-8"
_CHUNK = 1 << 16  # compressed bytes per read when checking or decompressing a whole stream


@dataclass(frozen=True)
class InputFile:
    """One logical input. ``name`` is stable and short: it appears in row ids and error messages."""

    path: str
    name: str
    kind: str  # jsonl | openai | parquet | arrow | hf
    split: str | None = None
    arrow_files: tuple[str, ...] = ()  # for kind == arrow: the dataset's .arrow stream files in order

    def content_files(self) -> list[str]:
        """The files whose bytes define this input (for the fingerprint)."""
        if self.kind == "arrow":
            return list(self.arrow_files)
        if is_url(self.path):
            return [self.path]
        if os.path.isdir(self.path):
            return sorted(str(p) for p in Path(self.path).rglob("*") if p.is_file() and not _hidden(p))
        return [self.path]


class RowBatch:
    """A batch of input rows. Tabular sources keep the Arrow batch and build Python rows only on demand, so
    rows that resume skips (already committed) or another shard owns are never converted."""

    consumed: int | None = None  # JSON Lines: bytes of the file (compressed, as on disk) read up to this batch
    digests: list[int] | None = None  # JSON Lines: a 64-bit digest of each row's line (``line_digest``)
    ends: list[int] | None = None  # JSON Lines: where each row's line ends (bytes of the decompressed text)

    def __init__(self, file: InputFile, indices: Sequence[int], rows: list[dict[str, Any] | RowError] | None = None,
                 record: pa.RecordBatch | None = None):
        self.file = file
        self.indices = indices  # row index within the file of each row (JSONL: line number - 1)
        self._rows = rows
        self.record = record

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def rows(self) -> list[dict[str, Any] | RowError]:
        if self._rows is None:
            assert self.record is not None
            self._rows = _rows_of(self.file, self.indices, self.record)
        return self._rows

    def rows_at(self, picks: list[int]) -> list[dict[str, Any] | RowError]:
        if self._rows is not None or len(picks) == len(self):
            rows = self.rows
            return rows if len(picks) == len(rows) else [rows[k] for k in picks]
        assert self.record is not None
        return _rows_of(self.file, [self.indices[k] for k in picks], self.record.take(pa.array(picks, pa.int64())))

    def column(self, name: str) -> list[Any]:
        """One column's values (None where missing or the row is an error), without building whole rows."""
        if self._rows is None and self.record is not None:
            if name not in self.record.schema.names:
                return [None] * len(self)
            try:
                return self.record.column(name).to_pylist()
            except (pa.ArrowException, UnicodeDecodeError, ValueError):
                pass
        return [r.get(name) if isinstance(r, dict) else None for r in self.rows]

    def head(self, n: int) -> RowBatch:
        if self._rows is not None:
            return RowBatch(self.file, self.indices[:n], self._rows[:n])
        assert self.record is not None
        return RowBatch(self.file, self.indices[:n], None, self.record.slice(0, n))


def _hidden(p: Path) -> bool:
    return any(part.startswith((".", "_")) for part in p.parts[-1:])


def resolve_inputs(args: list[str], split: str | None = None) -> list[InputFile]:
    """Expand paths, directories and globs into ``InputFile``s with stable names; reject what we can't read."""
    found: list[tuple[str, str, str, tuple[str, ...]]] = []  # (path, kind, split, arrow files)
    if any(is_url(a) for a in args):
        return _resolve_urls(args, split)
    for arg in args:
        if any(ch in arg for ch in "*?["):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise UsageError(f"{arg}: the pattern matches no files")
            for m in matches:  # like pyarrow.dataset: names starting with _ or . are not data
                if os.path.isfile(m) and not os.path.basename(m).startswith(("_", ".")):
                    found.append((m, _file_kind(m), "", ()))
            continue
        if not os.path.exists(arg):
            raise UsageError(f"{arg}: no such file or directory")
        if os.path.isdir(arg):
            found.extend(_dir_inputs(arg, split))
        else:
            found.append((arg, _file_kind(arg), "", ()))
    if not found:
        raise UsageError("no input files")
    real = [os.path.realpath(p) for p, *_ in found]
    dupes = {p for p in real if real.count(p) > 1}
    if dupes:
        raise UsageError(f"{sorted(dupes)[0]}: given more than once (rows would be duplicated)")
    common = os.path.commonpath([os.path.dirname(p) for p in real])
    out = []
    for (_, kind, sp, arrow_files), rp in zip(found, real, strict=True):
        name = os.path.relpath(rp, common)
        if kind == "hf":
            name = f"{name}/{sp}"
        if kind == "jsonl":
            _check_jsonl(rp)
            if _is_openai_batch(rp):
                kind = "openai"
        out.append(InputFile(rp, name, kind, sp or None, arrow_files))
    return out


def _resolve_urls(args: list[str], split: str | None) -> list[InputFile]:
    """``resolve_inputs`` for URLs (all inputs of a job are URLs, or all local): globs expanded on the store, a
    "directory" read as the Parquet files under it, named relative to the inputs' common prefix like local
    files are. The URL is kept whole in ``path`` (it is how the file is opened again); messages show ``name``."""
    if not all(is_url(a) for a in args):
        raise UsageError("mix of URLs and local paths as inputs; copy one side over, or run them as two jobs")
    found: list[tuple[str, str]] = []
    for arg in args:
        store.need_library(arg)
        if split:
            raise UsageError(f"{redact(arg)}: --split (a Hugging Face dataset directory) is only read from a local "
                             "path; point at the split's Parquet/JSONL files instead")
        with store.store_errors(arg):
            if any(ch in arg.split("://", 1)[1] for ch in "*?["):
                matches = [m for m in store.glob(arg) if not m.rsplit("/", 1)[-1].startswith(("_", "."))]
                if not matches:
                    raise UsageError(f"{redact(arg)}: the pattern matches no files")
                found.extend((m, _file_kind(redact(m))) for m in matches)
            elif not store.exists(arg):
                raise UsageError(f"{redact(arg)}: no such file or directory")
            elif store.isdir(arg):
                base = arg.rstrip("/")
                files = [f for f in store.find(base, ".parquet")
                         if not any(x.startswith((".", "_")) for x in f[len(base) + 1:].split("/"))]
                if not files:
                    raise UsageError(f"{redact(arg)}: no Parquet files under this prefix")
                found.extend((f, "parquet") for f in files)
            else:
                found.append((arg, _file_kind(redact(arg))))
    urls = [u for u, _ in found]
    dupes = {u for u in urls if urls.count(u) > 1}
    if dupes:
        raise UsageError(f"{redact(sorted(dupes)[0])}: given more than once (rows would be duplicated)")
    common = os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in urls])
    out = []
    for url, kind in found:
        name = url.split("://", 1)[1][len(common):].lstrip("/")
        if kind == "jsonl":
            _check_jsonl(url)
            if _is_openai_batch(url):
                kind = "openai"
        out.append(InputFile(url, name, kind))
    return out


def parquet_file(path: str) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` for a path or a URL (ranged reads through fsspec: only the footer and
    the row groups read are fetched, never the whole file first)."""
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.ParquetFile(path)
    return pq.ParquetFile(store.open_file(path, "rb"))


def _file_kind(path: str) -> str:
    low = path.lower()
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(".arrow"):
        raise UsageError(f"{path}: pass the dataset directory (made by save_to_disk), not its .arrow file")
    raise UsageError(f"{path}: unknown input format (expected .jsonl[.gz|.zst], .parquet, or a dataset dir)")


def _dir_inputs(path: str, split: str | None) -> list[tuple[str, str, str, tuple[str, ...]]]:
    p = Path(path)
    if (p / "dataset_dict.json").exists():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        if not split:
            raise UsageError(f"{path}: a DatasetDict with splits {splits}; choose one with --split")
        if split not in splits:
            raise UsageError(f"{path}: no split {split!r} (splits: {', '.join(splits)})")
        return [(str(p / split), "arrow", split, _arrow_files(p / split))]
    if (p / "state.json").exists() and (p / "dataset_info.json").exists():
        return [(path, "arrow", "", _arrow_files(p))]
    if split:
        return [(path, "hf", split, ())]
    files = sorted(str(f) for f in p.rglob("*.parquet") if not any(x.startswith((".", "_")) for x in
                                                                     f.relative_to(p).parts))
    if files:
        return [(f, "parquet", "", ()) for f in files]
    raise UsageError(f"{path}: no Parquet files and not a save_to_disk dataset (a local HF dataset needs --split)")


def _arrow_files(p: Path) -> tuple[str, ...]:
    state = json.loads((p / "state.json").read_text())
    if state.get("_indices_data_files"):
        raise UsageError(f"{p}: dataset has an indices mapping (select/shuffle); run .flatten_indices() and "
                         "save_to_disk again")
    return tuple(str(p / f["filename"]) for f in state.get("_data_files", []))


def _open_text_stream(path: str) -> io.BufferedIOBase:
    """The file's bytes, decompressed. A .zst is read frame by frame and a truncated last frame is an error
    (zstandard's own stream reader just stops there, silently dropping the rest of the rows)."""
    low = path.lower().split("?", 1)[0]
    raw = store.open_file(path, "rb")  # closed by the caller through the wrapper
    if low.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if low.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(raw, path))
    return raw  # type: ignore[return-value]


class _ZstdFrames(io.RawIOBase):
    """Decompresses every frame of a .zst file in turn; raises EOFError if the data stops inside a frame."""

    def __init__(self, raw: io.BufferedIOBase, path: str):
        try:
            import zstandard
        except ImportError as e:
            raw.close()
            raise UsageError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from e
        self._raw, self._dctx = raw, zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressobj of the current frame; None before the first byte
        self._out, self._pos = memoryview(b""), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._pos >= len(self._out):
            data = self._raw.read(_CHUNK)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("compressed data ends inside a frame (truncated file?)")
                return 0
            parts = []
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._dctx.decompressobj()
                parts.append(self._frame.decompress(data))
                data = self._frame.unused_data if self._frame.eof else b""
            self._out, self._pos = memoryview(b"".join(parts)), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _stream_errors() -> tuple[type[BaseException], ...]:
    """What a damaged compressed stream raises: gzip raises OSError/EOFError/zlib.error, zstandard ZstdError."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def _jsonl_lines(f: io.BufferedIOBase) -> Iterator[bytes]:
    """The stream's lines with a UTF-8 byte-order mark removed from the first (editors on Windows add one;
    left in place it makes the first row malformed JSON)."""
    lines = iter(f)
    first = next(lines, None)
    if first is None:
        return
    yield first.removeprefix(UTF8_BOM)
    yield from lines


def _check_jsonl(path: str) -> None:
    """Refuse, before any work, the JSON Lines inputs that cannot be read as such: a damaged .gz/.zst (found by
    decompressing it all once: failing half-way through a run would leave a partial output committed), UTF-16
    text, and a whole-file JSON array (a common mix-up: say so instead of reporting every line as malformed)."""
    fmt = COMPRESSED_SUFFIXES.get(os.path.splitext(path.lower().split("?", 1)[0])[1])
    try:
        with _open_text_stream(path) as f:
            head = f.read(4096)
            while fmt and f.read(1 << 20):
                pass
    except _stream_errors() as e:
        if not fmt:
            raise UsageError(f"{redact(path)}: unreadable ({_short(e)})") from e
        raise UsageError(f"{redact(path)}: damaged {fmt} data: {_short(e)} (the file is truncated or corrupt; "
                         "nothing was read from it)") from e
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UsageError(f"{redact(path)}: UTF-16 text (byte-order mark {head[:2].hex()}); dspine-batch reads UTF-8 "
                         "JSON Lines: convert it (e.g. iconv -f UTF-16 -t UTF-8)")
    if head.removeprefix(UTF8_BOM).lstrip().startswith(b"["):
        raise UsageError(f"{redact(path)}: looks like a JSON array; dspine-batch reads JSON Lines (one object per "
                         "line)")


def mentions(inp: InputFile, pattern: re.Pattern[bytes], longest: int) -> bool:
    """Whether a JSON Lines input's bytes match ``pattern`` anywhere (no match is ``longest`` bytes or more), read
    in 1 MiB chunks: one regex pass, no JSON parsing, so a scan for a few keys costs almost nothing on inputs
    that never mention them."""
    tail = b""
    try:
        with _open_text_stream(inp.path) as f:
            while chunk := f.read(1 << 20):
                if pattern.search(tail + chunk):
                    return True
                tail = chunk[-longest:]
    except _stream_errors() as e:
        raise FatalError(f"{inp.name}: unreadable ({_short(e)})") from e
    return False


def _is_openai_batch(path: str) -> bool:
    try:
        with _open_text_stream(path) as f:
            for line in _jsonl_lines(f):
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and "custom_id" in obj and isinstance(obj.get("body"), dict)
    except (ValueError, RecursionError, *_stream_errors()):
        return False
    return False


def peek_rows(inp: InputFile, n: int = 100) -> list[dict[str, Any]]:
    """The first few good rows, for column detection and JSONL type inference.

    Reads on past bad rows until it finds a good one. A file with rows but not one good row is not "empty":
    raise what is wrong with it instead (e.g. Latin-1 text, where every line is invalid UTF-8)."""
    bad, first_bad, all_utf8 = 0, None, True
    for batch in iter_file(inp, columns=None, batch_rows=n):
        rows = batch.rows
        good = [r for r in rows if isinstance(r, dict)]
        if good:
            return good
        for r in rows:
            if isinstance(r, RowError):
                bad += 1
                first_bad = first_bad or r
                all_utf8 = all_utf8 and r.message.startswith(_NOT_UTF8)
    if first_bad is None:
        return []
    where = f"first: {first_bad}"
    if all_utf8:
        raise UsageError(f"{inp.name}: not UTF-8 text: {bad} lines could not be decoded ({where}); convert it, "
                         "e.g. iconv -f LATIN1 -t UTF-8")
    raise UsageError(f"{inp.name}: no usable row: all {bad} rows are errors ({where})")


def arrow_schema(inp: InputFile) -> pa.Schema | None:
    """The input's Arrow schema when the format has one (Parquet, Arrow datasets); None for JSONL/HF."""
    try:
        if inp.kind == "parquet":
            return parquet_file(inp.path).schema_arrow
        if inp.kind == "arrow":
            if not inp.arrow_files:
                return None
            with pa.memory_map(inp.arrow_files[0]) as src:
                return pa.ipc.open_stream(src).schema
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{inp.name}: unreadable ({_short(e)})") from e
    return None


def iter_file(inp: InputFile, columns: list[str] | None, batch_rows: int = BATCH_ROWS,
              needles: re.Pattern[bytes] | None = None, start: Start | None = None) -> Iterator[RowBatch]:
    """The rows of one input. ``needles``: JSON Lines rows whose bytes do not match are skipped unparsed (a
    quick pre-filter for scans that only care about rows mentioning some keys). ``start``: begin at that row
    position (a resume's watermark) without reading what lies before it where the format allows (``Start``)."""
    if inp.kind in ("jsonl", "openai"):
        yield from _iter_jsonl(inp, batch_rows, needles, start)
    elif inp.kind == "parquet":
        yield from _iter_parquet(inp, columns, batch_rows, start.index if start else 0)
    elif inp.kind == "arrow":
        yield from _iter_arrow(inp, columns, batch_rows, start.index if start else 0)
    elif inp.kind == "hf":
        yield from _iter_hf(inp, columns, batch_rows, start.index if start else 0)
    else:  # pragma: no cover - resolve_inputs only makes the kinds above
        raise FatalError(f"{inp.name}: unknown input kind {inp.kind}")


@dataclass(frozen=True)
class Start:
    """Where a resume starts reading a file: row position ``index`` (a Parquet/Arrow row, a JSON Lines line) and,
    for JSON Lines, the byte ``offset`` in the decompressed text where that line starts (-1: unknown). Parquet
    skips whole row groups, then rows; Arrow datasets slice by index; a plain JSON Lines file seeks to the offset;
    a compressed one cannot seek, so its bytes before the offset are decompressed and dropped without being split
    into lines, parsed or hashed; an HF dataset skips by index."""

    index: int
    offset: int = -1


def iter_inputs(files: list[InputFile], columns: list[str] | None, limit: int | None = None,
                batch_rows: int = BATCH_ROWS, needles: re.Pattern[bytes] | None = None,
                starts: dict[str, Start] | None = None) -> Iterator[RowBatch]:
    """All rows of all inputs in a stable order, at most ``limit`` rows in total (``needles``: see
    ``iter_file``; not with a limit, which counts the rows it skips; ``starts``: input name -> ``Start``, not with
    a limit either)."""
    assert needles is None or limit is None
    assert not starts or limit is None
    left = limit if limit is not None else -1
    for inp in files:
        for batch in iter_file(inp, columns, batch_rows, needles, (starts or {}).get(inp.name)):
            if left >= 0:
                if left == 0:
                    return
                if len(batch) > left:
                    batch = batch.head(left)
                left -= len(batch)
            yield batch
        if left == 0:
            return


def _seek_text(f: io.BufferedIOBase, start: Start | None) -> int:
    """Position the decompressed stream ``f`` at ``start``'s line; returns the index of the line it is at: 0 with
    no start (or none worth seeking to), -1 when the offset does not check out (``f`` is then closed, and the
    caller reads from the top, as before watermarks). The byte before the offset must be a newline: a wrong offset
    is never trusted (the input's fingerprint already refuses a changed file)."""
    if start is None or start.index <= 0 or start.offset <= 0:
        return 0
    try:
        if f.seekable():
            f.seek(start.offset - 1)
        else:  # a .zst stream: decompress and drop
            left = start.offset - 1
            while left > 0 and (chunk := f.read(min(left, 1 << 20))):
                left -= len(chunk)
            if left:
                raise ValueError("shorter than the watermark")
        if f.read(1) == b"\n":
            return start.index
    except (OSError, ValueError, EOFError):
        pass
    f.close()
    return -1


def _iter_jsonl(inp: InputFile, batch_rows: int, needles: re.Pattern[bytes] | None = None,
                start: Start | None = None) -> Iterator[RowBatch]:
    openai = inp.kind == "openai"
    rows: list[dict[str, Any] | RowError] = []
    indices: list[int] = []
    digests: list[int] = []
    ends: list[int] = []
    index = -1
    try:
        f = _open_text_stream(inp.path)
        first = _seek_text(f, start)
        if first < 0:  # the offset did not check out: read from the top
            f, first = _open_text_stream(inp.path), 0
        pos = start.offset if first else 0
        with f:
            for index, line in enumerate(f, first):
                pos += len(line)
                if index == 0:  # (``_jsonl_lines``' byte-order mark, removed here where the offsets are counted)
                    line = line.removeprefix(UTF8_BOM)
                if not line.strip():
                    continue  # blank lines are not rows (their line number is still counted)
                if needles is not None and needles.search(line) is None:
                    continue
                rows.append(_parse_line(inp.name, index, line, openai))
                indices.append(index)
                digests.append(line_digest(line))
                ends.append(pos)
                if len(rows) >= batch_rows:
                    yield _at(RowBatch(inp, indices, rows), f, digests, ends)
                    rows, indices, digests, ends = [], [], [], []
    except _stream_errors() as e:
        # Damaged after resolve_inputs checked it (changed during the run): rows before the damage were yielded.
        raise FatalError(f"{inp.name}: unreadable after row {index} ({_short(e)})") from e
    if rows:
        yield _at(RowBatch(inp, indices, rows), None, digests, ends)


def line_digest(line: bytes) -> int:
    """A line's identity, for ``--retry-errors`` to prove which lines of a fixed input changed (line ending aside)."""
    return int.from_bytes(hashlib.blake2b(line.rstrip(b"\r\n"), digest_size=8).digest(), "little")


def _at(batch: RowBatch, f: io.BufferedIOBase | None, digests: list[int], ends: list[int]) -> RowBatch:
    """The batch with how far into its file (bytes on disk) the reader is: the progress's share of a JSONL read
    (``totals.ReadPosition``); None for the end of the file. And its lines' digests and end offsets."""
    batch.digests, batch.ends = digests, ends
    raw = getattr(getattr(f, "raw", None), "_raw", None) or getattr(f, "fileobj", None) or f  # zst / gz / plain
    try:
        batch.consumed = raw.tell() if raw is not None else store.size(batch.file.path)
    except (OSError, ValueError, AttributeError):
        pass
    return batch


def _parse_line(name: str, index: int, line: bytes, openai: bool) -> dict[str, Any] | RowError:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RowError(name, index, None, f"{_NOT_UTF8} (byte 0x{line[e.start]:02x} at offset {e.start})")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the interpreter's stack
        return RowError(name, index, None, f"malformed JSON ({str(e)[:200]})")
    if not isinstance(obj, dict):
        return RowError(name, index, None, f"expected a JSON object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(line) and (where := _lone_surrogate(obj)) is not None:
        return RowError(name, index, where, "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                        "pair): not Unicode text")
    return _openai_row(name, index, obj) if openai else obj


# A JSON escape of a UTF-16 surrogate: ``json.loads`` turns an unpaired one into a str that cannot be encoded as
# UTF-8, which would fail far from the row (hashing a structure, tokenizing, writing Parquet). Rows whose bytes
# hold such an escape (rare: only text beyond the BMP written with ASCII-only JSON) are checked string by string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``body.messages[0].content``) of the first string or key in ``value`` that is not encodable
    as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or None
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if _lone_surrogate(k, where) is not None:
                return where.encode("utf-8", "backslashreplace").decode("utf-8")
            if (found := _lone_surrogate(v, where)) is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _lone_surrogate(v, f"{path}[{i}]")) is not None:
                return found
    return None


def _openai_row(name: str, index: int, obj: dict[str, Any]) -> dict[str, Any] | RowError:
    """Flatten an OpenAI batch line into our row shape: custom_id, and the body's keys under their own names
    (``requests`` reads the request fields and names them ``body.<key>``; the mapper refuses the others, so an
    error row still carries its custom_id)."""
    body = obj.get("body")
    if "custom_id" not in obj:
        return RowError(name, index, "custom_id", "missing (OpenAI batch line)")
    if not isinstance(body, dict):
        return RowError(name, index, "body", "missing or not an object (OpenAI batch line)")
    row = {k: v for k, v in body.items() if k not in IGNORED_BODY_KEYS and k != "custom_id"}
    row["custom_id"] = obj["custom_id"]
    return row


def _rows_of(inp: InputFile, indices: Sequence[int], batch: pa.RecordBatch) -> list[dict[str, Any] | RowError]:
    try:
        return batch.to_pylist()  # type: ignore[return-value]
    except (pa.ArrowException, UnicodeDecodeError, ValueError):
        out: list[dict[str, Any] | RowError] = []
        for i in range(batch.num_rows):
            try:
                out.append(batch.slice(i, 1).to_pylist()[0])
            except (pa.ArrowException, UnicodeDecodeError, ValueError) as e:
                out.append(RowError(inp.name, indices[i], None, f"undecodable value ({_short(e)})"))
        return out


def _iter_parquet(inp: InputFile, columns: list[str] | None, batch_rows: int, first: int = 0) -> Iterator[RowBatch]:
    """The file's rows from row ``first`` on: whole row groups before it are skipped by their footer counts (never
    read), then the rows before it in its row group are cut from the batches."""
    start = 0
    try:
        pf = parquet_file(inp.path)
        cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
        for rg in range(pf.num_row_groups):
            if start + pf.metadata.row_group(rg).num_rows <= first:
                start += pf.metadata.row_group(rg).num_rows
                continue
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=cols):
                if start + batch.num_rows <= first:
                    start += batch.num_rows
                    continue
                if start < first:
                    batch, start = batch.slice(first - start), first
                yield RowBatch(inp, range(start, start + batch.num_rows), None, batch)
                start += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise FatalError(f"{inp.name}: unreadable Parquet at row {start} ({_short(e)})") from e


def _iter_arrow(inp: InputFile, columns: list[str] | None, batch_rows: int, first: int = 0) -> Iterator[RowBatch]:
    """The dataset's rows from row ``first`` on (memory mapped: the record batches before it are never touched)."""
    start = 0
    try:
        for path in inp.arrow_files:
            with pa.memory_map(path) as src:
                reader = pa.ipc.open_stream(src)
                for big in reader:
                    if start + big.num_rows <= first:
                        start += big.num_rows
                        continue
                    if start < first:
                        big, start = big.slice(first - start), first
                    if columns is not None:
                        big = big.select([c for c in columns if c in big.schema.names])
                    for off in range(0, big.num_rows, batch_rows):
                        batch = big.slice(off, batch_rows)
                        yield RowBatch(inp, range(start, start + batch.num_rows), None, batch)
                        start += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise FatalError(f"{inp.name}: unreadable dataset file at row {start} ({_short(e)})") from e


def _iter_hf(inp: InputFile, columns: list[str] | None, batch_rows: int, first: int = 0) -> Iterator[RowBatch]:
    try:
        import datasets
    except ImportError as e:
        raise UsageError(f"{inp.path}: a local HF dataset needs the datasets package "
                         "(pip install 'dspine-batch[datasets]')") from e
    try:
        ds = datasets.load_dataset(inp.path, split=inp.split, streaming=True)
    except Exception as e:  # datasets raises many types for a bad dir/split
        raise UsageError(f"{inp.path}: cannot load split {inp.split!r} ({_short(e)})") from e
    start = max(first, 0)
    if start:
        ds = ds.skip(start)
    for batch in ds.iter(batch_size=batch_rows):
        keys = [k for k in batch if columns is None or k in columns]
        n = len(next(iter(batch.values()))) if batch else 0
        rows: list[dict[str, Any] | RowError] = [{k: batch[k][i] for k in keys} for i in range(n)]
        yield RowBatch(inp, range(start, start + n), rows)
        start += n


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return redact(text)[:200]
