"""Suffix proposals in the SGLang worker: which rows verify a suffix match instead of the DSpine draft's block.

The reference engine's ``SuffixSource`` (``dspine.decoding.suffix``) runs on the scheduler's host side, keyed by
SGLang's request id: a row's text is its ``origin_input_ids`` plus its ``output_ids`` (read from the batch's
``Req`` objects every decode round), rows sharing a prompt read each other's text, and a finished request's
output joins the stream's index. Each round ``choose`` picks per row a continuation of its text or the draft's
block, on the host and without waiting for the device: under overlap scheduling ``output_ids`` lacks the last
round's tokens, so the continuation offered is long enough to cover them and ``align`` (on the device) keeps what
follows the tokens the host has not seen, where the offer agrees with them (``dspine.sglang.rounds``). The worker
writes the result over the block's draft slots (and, for the sampled accept, a point mass q on them) just before
the verify, on the eager and the captured draft path alike, so verification, the commit (ReplaySSM included) and
SGLang's own stats are unchanged.

No SGLang import: the worker (``dspine.sglang.worker``) feeds it ``Req``-like objects.

Modes (``DSPINE_PROPOSERS``, set by ``dspine-batch --engine sglang --engine-arg proposers=...``):

* ``dspine``: the draft's block every round (no suffix index is kept).
* ``suffix``: a row's suffix proposal whenever it has one, the draft's block otherwise (SGLang verifies a block
  every round and the draft forward runs anyway, so there is no plain step to fall back to). Sampled rows too
  (point-mass q): exact in distribution, but their tokens then depend on other rows' text (the batch, the
  order of the job, what a resumed engine has seen).
* ``auto`` (the batch tool's default): greedy rows only, the suffix proposal where its estimated accepted tokens
  beat the row's draft record (the reference engine's survival estimate, ``dspine.decoding.decode``
  ``acceptance.suffix_survival``, against a shrunk per-row mean of the draft's accepted tokens per round). Sampled rows
  keep the draft's block, so their tokens never depend on other rows (as in the reference engine, whose sampled
  rows under ``auto`` never mix the two sources either). Greedy outputs are plain decoding's whatever is proposed;
  only the speculative stats depend on the history (a resumed engine starts with an empty finished index).

Each round's source and counts per request also go to the client: ``count_round`` adds them to the request's
``customized_info`` (``SourceCounts``), which SGLang returns in ``meta_info["dspine_source_counts"]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from dspine.decoding.acceptance import AGREEMENT_WEIGHT, SUFFIX_PRIOR, SUFFIX_PRIOR_WEIGHT
from dspine.decoding.suffix import DEFAULT_CAP_TOKENS, SuffixSource, Suggestion
from dspine.sglang import SOURCE_COUNTS_KEY
from dspine.sglang.rounds import settled, to_device

PROPOSERS_ENV = "DSPINE_PROPOSERS"  # auto | dspine | suffix (unset: dspine, SGLang launched by hand)
# Test/audit aid: one JSON line per verify round: {"rid": [...], "source": ["suffix"|"dspine", ...],
# "proposed": [...], "accepted": [...]} (suffix tokens proposed, accepted drafts excluding the bonus).
ROUND_LOG_ENV = "DSPINE_SGLANG_ROUND_LOG"
PROPOSERS = ("auto", "dspine", "suffix")

DRAFT_PRIOR = 1.0  # accepted draft tokens per round assumed for a row before it has evidence
DRAFT_PRIOR_WEIGHT = 4.0  # in pseudo-rounds
PRUNE_ROUNDS = 4096  # a row absent from this many decode rounds and not finished is dropped (aborted elsewhere)
SUFFIX, DSPINE = "suffix", "dspine"


def parse_mode(value: str | None) -> str:
    mode = (value or DSPINE).strip().lower()
    if mode not in PROPOSERS:
        raise ValueError(f"{PROPOSERS_ENV}={value!r}: expected one of {', '.join(PROPOSERS)}")
    return mode


class SourceCounts:
    """One request's verify rounds and drafted tokens by source, carried to the client in ``meta_info``.

    SGLang copies ``Req.customized_info[key]`` into ``meta_info[key]`` by slicing it per output token as each chunk
    of output leaves the scheduler (``req_values[sent:len(output_ids)]``), and the tokenizer process concatenates
    the chunks. So this object answers a slice with a per-token list whose first entry holds the counts added
    since the previous chunk (``{source: [rounds, proposed, accepted]}``) and the rest None: the client sums the
    entries (``dspine_batch.engines.sglang.stats``). Tokens are counted by who proposed them (the draft's tokens in
    the slots after a shorter suffix match are the draft's); a round by the source that led it."""

    def __init__(self) -> None:
        self.pending: dict[str, list[int]] = {}

    def add(self, source: str, rounds: int, proposed: int, accepted: int) -> None:
        c = self.pending.setdefault(source, [0, 0, 0])
        c[0] += rounds
        c[1] += proposed
        c[2] += accepted

    def __getitem__(self, key: slice) -> list:
        n = len(range(*key.indices(1 << 62)))
        out: list = [None] * n
        if n and self.pending:
            out[0], self.pending = self.pending, {}
        return out


def count_round(req: Any, pick: int, width: int, accepted: int) -> None:
    """Add one verify round of ``req`` to its ``SourceCounts``: ``pick`` suffix tokens over a block of ``width``
    draft slots (0: the draft's block), ``accepted`` drafts accepted (bonus excluded)."""
    info = getattr(req, "customized_info", None)
    if info is None:
        info = req.customized_info = {}
    counts = info.get(SOURCE_COUNTS_KEY)
    if not isinstance(counts, SourceCounts):
        counts = info[SOURCE_COUNTS_KEY] = SourceCounts()
    ours = min(accepted, pick)
    if pick:
        counts.add(SUFFIX, 1, pick, ours)
    if width > pick:
        counts.add(DSPINE, 0 if pick else 1, width - pick, accepted - ours)


@dataclass
class _Row:
    req: Any
    seen: int = 0  # output tokens already in the index
    last_round: int = 0
    draft_rounds: int = 0
    draft_accepted: int = 0
    sfx_hits: int = 0  # accepted suffix tokens
    sfx_trials: int = 0  # accepted + rejected suffix tokens (a rejection ends the trial)


class SuffixProposer:
    """Per-request suffix corpora, the per-round choice on the host and its accounting (see the module docstring).

    ``choose`` runs before a round on what the host knows (``output_ids``, a round behind under overlap scheduling)
    and offers each chosen row a continuation long enough to cover one unseen round; ``align`` (device) keeps the
    part after the tokens the host has not seen, where those agree with it; ``record`` settles the round from what
    SGLang reports once it has the round on the host (accepted drafts) and what ``align`` used."""

    def __init__(self, mode: str, width: int, cap_tokens: int = DEFAULT_CAP_TOKENS, log_path: str | None = None):
        self.mode = parse_mode(mode)
        self.width = int(width)  # draft slots of a block (B - 1)
        self.reach = 2 * self.width + 1  # tokens offered: one unseen round (<= B) and a block's drafts (B - 1)
        self.src = SuffixSource(cap_tokens=cap_tokens, max_len=max(1, self.reach))
        self.rows: dict[str, _Row] = {}
        self.round = 0
        self.log_path = log_path

    @property
    def active(self) -> bool:
        return self.mode != DSPINE

    # -- the rows' text --------------------------------------------------------------------------------------

    def _start(self, rid: str, req: Any) -> _Row:
        if rid in self.src.rows:
            self.src.finish(rid)
        self.src.start(rid, [int(t) for t in req.origin_input_ids])
        row = self.rows[rid] = _Row(req)
        return row

    def _catch_up(self, rid: str, row: _Row) -> None:
        out = row.req.output_ids
        if len(out) < row.seen:  # the request was reset (retracted): start its text again
            stats = row
            row = self._start(rid, row.req)
            row.draft_rounds, row.draft_accepted = stats.draft_rounds, stats.draft_accepted
            row.sfx_hits, row.sfx_trials = stats.sfx_hits, stats.sfx_trials
        if len(out) > row.seen:
            self.src.extend(rid, [int(t) for t in out[row.seen:]])
            row.seen = len(out)

    def sync(self, reqs: list[Any]) -> None:
        """Register new requests, append the tokens committed since last round, retire finished requests."""
        self.round += 1
        live = set()
        for req in reqs:
            rid = str(req.rid)
            live.add(rid)
            row = self.rows.get(rid)
            if row is None or row.req is not req:
                row = self._start(rid, req)
            self._catch_up(rid, row)
            self.rows[rid].last_round = self.round
        for rid in [r for r in self.rows if r not in live]:
            row = self.rows[rid]
            finished = bool(row.req.finished())
            if finished or self.round - row.last_round > PRUNE_ROUNDS:
                if finished:
                    self._catch_up(rid, row)
                self.src.finish(rid)
                del self.rows[rid]

    # -- the choice ------------------------------------------------------------------------------------------

    def _expected(self, row: _Row, sug: Suggestion) -> float:
        rate = (row.sfx_hits + SUFFIX_PRIOR * SUFFIX_PRIOR_WEIGHT) / (row.sfx_trials + SUFFIX_PRIOR_WEIGHT)
        surv, total = 1.0, 0.0
        for count, same in zip(sug.counts[: self.width], sug.sames[: self.width]):
            agree = (same + AGREEMENT_WEIGHT * rate) / (max(count - 1, 0) + AGREEMENT_WEIGHT)
            surv *= min(agree, rate + (1.0 - rate) * agree)
            total += surv
        return total

    def _draft_expected(self, row: _Row) -> float:
        return (row.draft_accepted + DRAFT_PRIOR * DRAFT_PRIOR_WEIGHT) / (row.draft_rounds + DRAFT_PRIOR_WEIGHT)

    def choose(self, reqs: list[Any], greedy: list[bool] | None = None) -> list[list[int] | None]:
        """Per row the continuation of its known text to offer (at most ``reach`` tokens) or None (the draft's
        block): sampled rows (``greedy`` False) only under ``suffix``; under ``auto`` where the match's estimated
        accepted tokens beat the row's draft record. Host data only (no device read)."""
        self.sync(reqs)
        greedy = [True] * len(reqs) if greedy is None else greedy
        out: list[list[int] | None] = []
        for req, g in zip(reqs, greedy, strict=True):
            rid = str(req.rid)
            row = self.rows[rid]
            pick = None
            if (g or self.mode == SUFFIX) and self.src.could_match(rid):
                sug = self.src.suggest(rid, self.reach)
                if sug is not None and sug.tokens and (
                        self.mode == SUFFIX or self._expected(row, sug) > self._draft_expected(row)):
                    pick = [int(t) for t in sug.tokens[: self.reach]]
            out.append(pick)
        return out

    def record(self, reqs: list[Any], used: list[int], accepted: list[int]) -> None:
        """One verify round, settled: per row the suffix tokens verified (``used``, 0: the draft's block) and the
        drafts accepted (bonus excluded), in the round's row order."""
        # a row SGLang does not settle this round (finished or retracted: under overlap scheduling such a row runs
        # one more round, whose tokens SGLang drops) is not counted either, as SGLang's own statistics do not
        keep = [settled(r) for r in reqs]
        rids = [str(r.rid) for r, k in zip(reqs, keep, strict=True) if k]
        used = [n for n, k in zip(used, keep, strict=True) if k]
        accepted = [a for a, k in zip(accepted, keep, strict=True) if k]
        for rid, n, acc in zip(rids, used, accepted, strict=True):
            row = self.rows.get(rid)
            if row is None:
                continue
            n, acc = int(n), int(acc)
            count_round(row.req, n, self.width, acc)
            if n:
                hits = min(acc, n)
                row.sfx_hits += hits
                row.sfx_trials += hits + (hits < n)
            else:
                row.draft_rounds += 1
                row.draft_accepted += acc
        if self.log_path:
            rec = {"rid": rids, "source": [SUFFIX if n else DSPINE for n in used],
                   "proposed": [int(n) or self.width for n in used], "accepted": [int(a) for a in accepted]}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def offer(self, picks: list[list[int] | None], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen continuations as device tensors: ``[bs, reach]`` (-1 padded) and their lengths."""
        rows = [(p or []) + [-1] * (self.reach - len(p or [])) for p in picks]
        return to_device(rows, torch.int64, device), to_device([len(p or []) for p in picks], torch.int64, device)


def align(offered: torch.Tensor, offered_len: torch.Tensor, unseen: torch.Tensor, ok: torch.Tensor,
          tail: torch.Tensor, tail_len: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [bs, width], n [bs]): each row's suffix proposal for this round's draft slots, on the device.

    ``offered`` continues the text the host knew; the device knows the ``unseen`` tokens committed since (the last
    ones of ``tail``, the row's last round, whose final token is this round's anchor). Where the offer starts with
    exactly those tokens, the proposal is what follows them (``n`` of its tokens are real); elsewhere ``n`` is 0
    and the row verifies the draft's block. No host synchronisation (safe under overlap scheduling and in graphs)."""
    bs, reach = offered.shape
    T = tail.shape[1]
    m = unseen.clamp(0, T)
    j = torch.arange(T, device=offered.device)
    at = (tail_len - m)[:, None] + j[None, :]
    seen_tail = tail.gather(1, at.clamp(0, T - 1))
    head = offered[:, :T] if reach >= T else torch.nn.functional.pad(offered, (0, T - reach), value=-1)
    differ = ((j[None, :] < m[:, None]) & (head != seen_tail)).any(1)
    cols = (m[:, None] + torch.arange(width, device=offered.device)[None, :]).clamp(max=reach - 1)
    tokens = offered.gather(1, cols)
    n = (offered_len - m).clamp(0, width)
    n = torch.where(ok & ~differ & (offered_len > 0), n, torch.zeros_like(n))
    return tokens, n
