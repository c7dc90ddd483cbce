"""A GGUF's key/value metadata read as the types its keys promise, each value checked before anything uses it.

Why: a GGUF's metadata sizes everything the conversion builds (heads, layers, the vocabulary, RoPE), and a damaged
or hand-made file can hold anything there: a head count of 0 divides by zero, a BOS id past the vocabulary indexes
out of range, a negative one silently names the last token, a string where a count belongs fails deep in a parser.
So every read says what it expects (a count, a positive number, a token id, a list of strings) and a value that is
not that fails at once, in one ``GGUFConversionError`` line naming the file and the key, as llama.cpp's loader
refuses a key of the wrong type. Which keys exist is the architecture's business (``gguf_arch``); this module only
knows how to read one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

_INTEGERS = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_REALS = _INTEGERS | {"FLOAT32", "FLOAT64"}


class GGUFConversionError(ValueError):
    """A GGUF that cannot be converted: unreadable, truncated, or not a model this converter handles."""


class Metadata:
    """Typed access to a GGUF's metadata (``reader``: a ``gguf.GGUFReader``), naming the file and key in every
    error. ``get`` returns a value as stored (no check); the other readers check type and range."""

    def __init__(self, reader: Any, path: Path):
        self.reader = reader
        self.path = path

    def fail(self, key: str, problem: str) -> GGUFConversionError:
        return GGUFConversionError(f"{self.path}: metadata key {key!r} {problem}")

    def _read(self, key: str, required: bool = False) -> tuple[list[str], Any] | None:
        """(the value's type names: one for a scalar, ["ARRAY", element type] for an array, its value); None for a key
        the file lacks, which is an error where ``required``."""
        field = self.reader.get_field(key)
        if field is None:
            if required:
                raise GGUFConversionError(f"{self.path}: metadata key {key!r} is missing")
            return None
        try:
            return [t.name for t in field.types], field.contents()
        except (ValueError, IndexError, TypeError) as e:  # undecodable text, an array cut short
            raise self.fail(key, f"cannot be read ({e})") from None

    def get(self, key: str, default: Any = None) -> Any:
        read = self._read(key)
        return default if read is None else read[1]

    def require(self, key: str) -> Any:
        return self._read(key, required=True)[1]

    def _scalar(self, key: str, kinds: set[str], what: str, required: bool) -> Any:
        read = self._read(key, required)
        if read is None:
            return None
        types, value = read
        if len(types) != 1 or types[0] not in kinds:
            raise self.fail(key, f"must be {what}, got {_shown(types, value)}")
        return value

    def count(self, key: str, default: int | None = None, minimum: int = 1) -> int | None:
        """An integer >= ``minimum`` (a size, a layer count); ``default`` when absent (None: required)."""
        value = self._scalar(key, _INTEGERS, "an integer", default is None)
        if value is None:
            return default
        if int(value) < minimum:
            raise self.fail(key, f"must be an integer >= {minimum}, got {int(value)}")
        return int(value)

    def number(self, key: str, default: float | None = None, positive: bool = True) -> float | None:
        """A finite real (an integer too), > 0 where ``positive``; ``default`` when absent (None: required)."""
        value = self._scalar(key, _REALS, "a number", default is None)
        if value is None:
            return default
        if not math.isfinite(float(value)) or (positive and float(value) <= 0):
            raise self.fail(key, f"must be a {'positive ' if positive else ''}finite number, got {float(value)!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._scalar(key, {"BOOL"}, "a bool", False)
        return default if value is None else bool(value)

    def text(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        value = self._scalar(key, {"STRING"}, "a string", required)
        return default if value is None else str(value)

    def token_id(self, key: str, n_tokens: int) -> int | None:
        """A token id inside a vocabulary of ``n_tokens`` (a negative one would name a token from the end)."""
        value = self._scalar(key, _INTEGERS, "a token id", False)
        if value is None:
            return None
        if not 0 <= int(value) < n_tokens:
            raise self.fail(key, f"is {int(value)}, outside the vocabulary of {n_tokens} tokens")
        return int(value)

    def array(self, key: str, kinds: set[str], what: str, required: bool = True) -> list | None:
        """A list whose elements are of ``kinds`` (``strings``, ``integers``, ``numbers``)."""
        read = self._read(key, required)
        if read is None:
            return None
        types, value = read
        if types[0] != "ARRAY" or (value and types[-1] not in kinds):
            raise self.fail(key, f"must be an array of {what}, got {_shown(types, value)}")
        return list(value)

    def strings(self, key: str, required: bool = True) -> list[str] | None:
        return self.array(key, {"STRING"}, "strings", required)

    def integers(self, key: str, required: bool = True) -> list[int] | None:
        return self.array(key, _INTEGERS, "integers", required)

    def numbers(self, key: str, required: bool = True) -> list[float] | None:
        values = self.array(key, _REALS, "numbers", required)
        if values is not None and not all(math.isfinite(float(x)) for x in values):
            raise self.fail(key, "holds a value that is not finite")
        return values


def _shown(types: list[str], value: Any) -> str:
    """How an error shows a value of the wrong type: its GGUF type and (briefly) the value."""
    kind = f"an array of {types[-1].lower()}" if types[0] == "ARRAY" else types[0].lower()
    if types[0] == "ARRAY":
        return kind
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"
