"""Model-free proposals: continuations of the text the row is writing, read from text already seen.

Batch jobs repeat themselves: answers quote their input (edits, rewrites, extraction, code changes), an answer
repeats its own phrases, the ``--num-samples`` siblings of a prompt write alike, and the rows of one template
answer alike. A suffix match finds the longest recent n-gram ending the row's text in text already seen and
proposes what followed it there (prompt lookup, SuffixDecoding and SGLang's NGRAM work this way; see
``docs/design.md``, "Suffix proposals"). A proposal costs a few dict look-ups, microseconds, where the DSpine
draft costs a forward; a wrong one costs only the verify slots it occupies, since verification is lossless.

``SuffixIndex`` is one corpus: token documents in a list, and a table from each n-gram (n in ``ORDERS``) to the
position after its most recent occurrence, with how often it occurred and how often the token after it repeated
the previous occurrence's (``count``, ``same``: the agreement the planner turns into an acceptance estimate).
Documents are appended whole or grown at the end (a row's prompt, then its tokens as they commit). A capped index
drops its oldest documents when it grows past the cap and re-indexes the rest (amortised: at most once per
``cap / 2`` added tokens).

``SuffixSource`` holds the corpora of one decoding stream: one index per running row over its prompt and output,
the rows sharing a prompt (``--num-samples`` siblings) read each other's, and one capped index per stream over
the outputs of finished rows (with the tail of their prompts, so the start of an answer matches too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

ORDERS = (2, 3, 4, 6, 8)  # n-gram lengths indexed; a longer match is tried first
MAX_PROPOSAL = 16  # tokens a proposal may hold (more than a DSpine block where the match is long)
DEFAULT_CAP_TOKENS = 1 << 18  # finished-output tokens a stream keeps (the oldest are dropped beyond it)
PROMPT_TAIL = 16  # prompt tokens kept before a finished output in the stream's index
MAX_SIBLINGS = 8  # running rows of the same prompt a row reads (the most recently started)

_POS_BITS = 40
_POS_MASK = (1 << _POS_BITS) - 1
_CNT_MASK = (1 << 12) - 1  # count and same saturate at 4095
_SEP = -1  # between documents: no n-gram spans it, no continuation crosses it


@dataclass
class Suggestion:
    """A proposed continuation: ``tokens`` and, per token, how often the n-gram before it occurred in the corpus
    (``counts``) and how often the token after it repeated the previous occurrence's (``sames``)."""

    tokens: list[int]
    counts: list[int]
    sames: list[int]
    match: int  # length of the n-gram that matched the row's text


class SuffixIndex:
    """n-gram -> most recent continuation, over token documents (see the module docstring)."""

    def __init__(self, orders: Sequence[int] = ORDERS, cap_tokens: int | None = None):
        self.orders = tuple(sorted(set(int(n) for n in orders)))
        if not self.orders or self.orders[0] < 1:
            raise ValueError(f"orders must be positive n-gram lengths, got {orders!r}")
        self.cap = cap_tokens
        self.buf: list[int] = []
        self.table: dict[int, int] = {}
        self.docs: deque[tuple[int, int]] = deque()  # (start, end) of each closed document in ``buf``
        self._start = 0  # start of the open document (the one ``extend`` grows)
        self._open = False

    def __len__(self) -> int:
        """Tokens held (separators excluded)."""
        return len(self.buf) - len(self.docs)

    def text(self) -> list[int]:
        """The open document's tokens (what a row's own index is matched against)."""
        return self.buf[self._start :] if self._open else []

    # -- writing ---------------------------------------------------------------------------------------------

    def open(self, tokens: Sequence[int] = ()) -> None:
        """Start a new document (closing the open one) holding ``tokens``."""
        self._close()
        self._start = len(self.buf)
        self._open = True
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the open document, indexing every n-gram whose next token is now known."""
        if not self._open:
            self.open()
        buf, table, start = self.buf, self.table, self._start
        for t in tokens:
            p = len(buf)
            t = int(t)
            for n in self.orders:
                if p - n < start:
                    break
                key = hash(tuple(buf[p - n : p]))
                v = table.get(key)
                if v is None:
                    table[key] = p | (1 << _POS_BITS)
                else:
                    prev = v & _POS_MASK
                    count = min(((v >> _POS_BITS) & _CNT_MASK) + 1, _CNT_MASK)
                    same = (v >> (_POS_BITS + 12)) + (prev < p and buf[prev] == t)
                    table[key] = p | (count << _POS_BITS) | (min(same, _CNT_MASK) << (_POS_BITS + 12))
            buf.append(t)

    def add(self, tokens: Sequence[int]) -> None:
        """Append a whole document; a capped index then drops old documents if it is over its cap."""
        self.open(tokens)
        self._close()
        if self.cap is not None and len(self) > self.cap:
            self._evict()

    def _close(self) -> None:
        if self._open:
            self.docs.append((self._start, len(self.buf)))
            self.buf.append(_SEP)
            self._open = False

    def _evict(self) -> None:
        """Keep the newest documents holding at most half the cap, and re-index them."""
        keep: list[list[int]] = []
        held = 0
        for s, e in reversed(self.docs):
            if held + (e - s) > self.cap // 2 and keep:
                break
            keep.append(self.buf[s:e][-(self.cap // 2) :])
            held += len(keep[-1])
        self.buf, self.table, self.docs, self._start, self._open = [], {}, deque(), 0, False
        for doc in reversed(keep):
            self.open(doc)
            self._close()

    # -- reading ---------------------------------------------------------------------------------------------

    def suggest(self, context: Sequence[int], max_len: int = MAX_PROPOSAL, overlap: bool = False) -> Suggestion | None:
        """The continuation of the longest indexed n-gram that ends ``context``, up to ``max_len`` tokens.

        ``overlap``: ``context`` is this index's own open document (a row reading its own text); a continuation
        that reaches the document's end then copies itself forward (LZ77-style), so a repeating stretch
        proposes its next period rather than one token. Elsewhere a continuation stops where the text ends."""
        if max_len <= 0:
            return None
        buf, table = self.buf, self.table
        for n in reversed(self.orders):
            if len(context) < n:
                continue
            v = table.get(hash(tuple(context[-n:])))
            if v is None:
                continue
            pos = v & _POS_MASK
            tokens, counts, sames = [], [], []
            end = len(buf)
            j = pos
            while len(tokens) < max_len:
                if j >= end and not overlap:
                    break
                t = buf[j] if j < end else tokens[j - end]
                if t == _SEP:
                    break
                if j > pos:  # the n-gram before this token, as the corpus saw it
                    if j <= end:
                        gram = buf[j - n : j]
                    elif j - n >= end:
                        gram = tokens[j - n - end : j - end]
                    else:
                        gram = buf[j - n : end] + tokens[: j - end]
                    v = table.get(hash(tuple(gram)), 1 << _POS_BITS)
                tokens.append(t)
                counts.append((v >> _POS_BITS) & _CNT_MASK)
                sames.append(v >> (_POS_BITS + 12))
                j += 1
            if tokens:
                return Suggestion(tokens, counts, sames, n)
        return None

    def nbytes(self) -> int:
        """Approximate memory held (CPython: ~8 bytes a buffer slot, ~100 a table entry)."""
        return 8 * len(self.buf) + 100 * len(self.table)


@dataclass
class _Entry:
    index: SuffixIndex
    group: int
    prompt_tail: list[int]
    tokens: list[int] = field(default_factory=list)


class SuffixSource:
    """The suffix corpora of one decoding stream: per running row, per prompt (siblings), per stream (finished).

    Rows are registered with ``start`` (their prompt), grown with ``extend`` (committed tokens) and ended with
    ``finish`` (their output joins the stream's index). ``suggest`` returns the longest match among the row's own
    text, its siblings' and the finished outputs (the row's own first on a tie).
    """

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS, max_len: int = MAX_PROPOSAL,
                 orders: Sequence[int] = ORDERS):
        self.max_len = int(max_len)
        self.orders = tuple(orders)
        self.finished = SuffixIndex(orders, cap_tokens=max(1, int(cap_tokens)))
        self.rows: dict[int, _Entry] = {}
        self.groups: dict[int, list[int]] = {}

    def start(self, key: int, prompt: Sequence[int]) -> None:
        index = SuffixIndex(self.orders)
        index.open(prompt)
        group = hash(tuple(prompt))
        self.rows[key] = _Entry(index, group, list(prompt[-PROMPT_TAIL:]))
        self.groups.setdefault(group, []).append(key)

    def extend(self, key: int, tokens: Sequence[int]) -> None:
        e = self.rows[key]
        e.index.extend(tokens)
        e.tokens.extend(int(t) for t in tokens)

    def finish(self, key: int) -> None:
        e = self.rows.pop(key, None)
        if e is None:
            return
        sibs = self.groups[e.group]
        sibs.remove(key)
        if not sibs:
            del self.groups[e.group]
        if e.tokens:
            self.finished.add(e.prompt_tail + e.tokens)

    def could_match(self, key: int) -> bool:
        """Whether ``suggest(key)`` (no ``tail``) can return a proposal: some corpus the row reads holds the n-gram
        of the smallest order that ends the row's text. A match of any order ends with that n-gram, and every
        position a longer n-gram is indexed at indexes it too, so without it every order misses everywhere and
        ``suggest`` returns None. One hash of a short tuple and a dict look-up per corpus, where ``suggest``
        copies the row's text and hashes every order in every corpus: the cheap test a lookup is skipped on."""
        e = self.rows[key]
        idx, n = e.index, min(self.orders)
        if not idx._open or len(idx.buf) - idx._start < n:
            return False  # shorter than every order: nothing can match (``suggest`` skips such contexts too)
        k = hash(tuple(idx.buf[-n:]))
        if k in idx.table or k in self.finished.table:
            return True
        rows = self.rows
        return any(k in rows[o].index.table for o in self.groups.get(e.group, ())[-MAX_SIBLINGS - 1 :] if o != key)

    def suggest(self, key: int, max_len: int | None = None, tail: Sequence[int] = ()) -> Suggestion | None:
        """The best continuation of row ``key``'s text (followed by ``tail``: tokens proposed before the match,
        e.g. those its grammar forces)."""
        e = self.rows[key]
        ctx = e.prompt_tail + e.tokens if len(e.tokens) < self.orders[-1] else e.tokens
        limit = self.max_len if max_len is None else min(self.max_len, max_len)
        if tail:
            ctx = list(ctx) + list(tail)
            best = e.index.suggest(e.index.text() + list(tail), limit)
        else:
            best = e.index.suggest(e.index.text(), limit, overlap=True)
        for other in self.groups.get(e.group, ())[-MAX_SIBLINGS - 1 :]:
            if other != key:
                s = self.rows[other].index.suggest(ctx, limit)
                if s is not None and (best is None or s.match > best.match):
                    best = s
        s = self.finished.suggest(ctx, limit)
        if s is not None and (best is None or s.match > best.match):
            best = s
        return best

    def memory(self) -> dict[str, int]:
        """Tokens and approximate bytes held: the finished-output index and the running rows' indexes."""
        rows = list(self.rows.values())
        return {"finished_tokens": len(self.finished), "finished_bytes": self.finished.nbytes(),
                "row_tokens": sum(len(e.index) for e in rows), "row_bytes": sum(e.index.nbytes() for e in rows)}
