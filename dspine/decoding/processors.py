"""One seam for everything a row's history does to its logits before sampling or acceptance.

Penalties, logit bias, ``min_tokens`` and a grammar's mask are all functions of what a row has produced so far,
applied to the logits of the slot being decided; temperature, top-k and top-p follow (``sampling.target_probs``).
Plain steps, the first token after the prompt and every verify slot go through ``process`` alike, a verify slot
``j`` with the row's committed tokens *plus the proposed tokens before it* as its history, so the distribution a
proposal is verified against is exactly the one plain decoding samples from at that position: losslessness under
any of these follows from using the same processed distribution everywhere (vLLM v1 keeps grammars at one
bitmask seam before its sampler for the same reason).

What each does, in this order (document of record: ``docs/design.md``, "Processed distribution"):

1. ``repetition_penalty`` p (HF / vLLM): every id in the prompt or the output so far, logit / p where the logit is
   positive, logit * p where not;
2. ``presence_penalty`` / ``frequency_penalty`` (OpenAI): ``logit -= presence * [count > 0] + frequency * count``
   over the ids generated so far (the prompt does not count);
3. ``logit_bias``: added to the given ids;
4. ``min_tokens``: the row's stop ids masked while it has generated fewer (unless nothing else is left);
5. the grammar's mask (``grammar.py``): every id the grammar does not allow at that point to -inf — on a greedy
   slot only where its unmasked argmax is refused (``needs_mask``: otherwise the argmax is the same token).

Logprobs are the model's own: the log-softmax of the raw logits at each committed token's position, before any of
the above and before temperature (what OpenAI and vLLM report by default), with the ``k`` most likely ids
(``Logprobs``). With our batch-invariant kernels a verify slot's logits are bit-identical to the plain step's at
that position, so speculative and plain runs report the same numbers.

Rows that ask for none of this cost nothing here: ``process`` returns the logits untouched when no row of the
round has state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dspine.decoding.grammar import apply_masks, new_bitmask, walk
from dspine.decoding.history import slot_history
from dspine.decoding.sampling import SamplingParams


@dataclass
class RowState:
    """What a row's processors need of its history: generated-id counts, ids seen (prompt and output), the
    grammar matcher, and the generated length."""

    sp: SamplingParams
    vocab_size: int
    counts: torch.Tensor | None = None  # [V] float: times each id was generated (presence / frequency)
    seen: torch.Tensor | None = None  # [V] bool: ids in the prompt or generated (repetition)
    matcher: Any = None  # xgrammar.GrammarMatcher
    generated: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    head_mask: torch.Tensor | None = None  # [1, words]: the grammar's mask at the matcher's state (``head``)

    @staticmethod
    def of(sp: SamplingParams, prompt: list[int], vocab_size: int) -> RowState | None:
        """The state a request needs, None when it needs none (the common case: no cost at all)."""
        if not sp.processed and sp.logprobs is None:
            return None
        st = RowState(sp, vocab_size)
        if sp.presence_penalty or sp.frequency_penalty:
            st.counts = torch.zeros(vocab_size)
        if sp.repetition_penalty != 1.0:
            st.seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = torch.tensor([t for t in prompt if 0 <= t < vocab_size], dtype=torch.long)
            st.seen[ids] = True
        if sp.grammar is not None:
            st.matcher = sp.grammar.matcher()
        return st

    def head(self) -> torch.Tensor:
        """The grammar's mask at the matcher's current state, filled once and kept until the row commits: the
        forced-token look-ahead and the verify's slot 0 read the same state in one round (one fill, not two)."""
        if self.head_mask is None:
            self.head_mask = new_bitmask(1, self.vocab_size)
            if not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(self.head_mask, 0)
        return self.head_mask

    @property
    def shapes(self) -> bool:
        """Whether this row changes its logits (logprobs alone do not)."""
        return self.sp.processed

    def commit(self, tokens: list[int]) -> None:
        """The row committed ``tokens``: they join its history (and its grammar's state)."""
        if tokens:
            self.head_mask = None  # the matcher moves: its mask is another
        for t in tokens:
            if self.counts is not None:
                self.counts[t] += 1
            if self.seen is not None:
                self.seen[t] = True
            if self.matcher is not None and not self.matcher.is_terminated() and not self.matcher.accept_token(t):
                raise RuntimeError(f"token {t} was committed but the row's grammar refuses it (a masking bug)")
        self.generated += len(tokens)


def grammar_masks(states: list[RowState | None], props: torch.Tensor | None, ell: torch.Tensor | None,
                  live: list[bool] | None = None) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """The masks of every slot the round will read for the constrained rows (``grammar.walk``), before the
    forward: {batch row: [ℓ' + 1, words]}, and ℓ cut where a proposed token is refused (None when no row has a
    grammar, or no row is cut)."""
    masks: dict[int, torch.Tensor] = {}
    cut = None
    for b, st in enumerate(states):
        if st is None or st.matcher is None or (live is not None and not live[b]):
            continue
        e = 0 if ell is None else int(ell[b])
        prop = [] if e == 0 else props[b, :e].tolist()
        m, taken = walk(st.matcher, prop, st.vocab_size, st.head)
        masks[b] = m
        if taken < e:
            if cut is None:
                cut = ell.clone()
            cut[b] = taken
    return masks, cut


def process(logits: torch.Tensor, states: list[RowState | None], b_idx: list[int], j_idx: list[int],
            props: torch.Tensor | None, masks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The processed logits (before temperature / top-k / top-p) of the slots ``logits`` [N, V] holds: slot n is
    row ``b_idx[n]``'s slot ``j_idx[n]`` (its history: committed tokens + ``props[b, :j]``). In place on the rows
    that change; the same tensor back when no row does. ``masks``: ``grammar_masks``' (computed here for slot 0
    when missing)."""
    rows: dict[int, list[int]] = {}
    for n, b in enumerate(b_idx):
        st = states[b]
        if st is not None and st.shapes:
            rows.setdefault(b, []).append(n)
    if not rows:
        return logits
    masked_rows, mask_list = [], []
    held: dict[int, torch.Tensor] = {}  # slot -> its stop ids' logits before min_tokens (rows with a grammar)
    for b, ns in rows.items():
        st, sp = states[b], states[b].sp
        js = [j_idx[n] for n in ns]
        idx = torch.tensor(ns, dtype=torch.long)
        if st.seen is not None or st.counts is not None:
            x = logits[idx]
            drafts = props[b, : max(js)].tolist() if props is not None and max(js) else []
            seen, c = slot_history(st.seen, st.counts, drafts, js)  # slot j: the proposals before it included
            if seen is not None:  # repetition: prompt + output ids
                p = sp.repetition_penalty
                x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
            if c is not None:  # presence / frequency over the generated ids
                x = x - sp.presence_penalty * (c > 0).float() - sp.frequency_penalty * c
            logits[idx] = x
        if sp.logit_bias:
            ids = torch.tensor([i for i, _ in sp.logit_bias], dtype=torch.long)
            bias = torch.tensor([v for _, v in sp.logit_bias], dtype=logits.dtype)
            logits[idx[:, None], ids[None, :]] += bias
        if sp.min_tokens and sp.stop_token_ids:
            early = [n for n, j in zip(ns, js) if st.generated + j < sp.min_tokens]
            if early:
                stops = torch.tensor(sp.stop_token_ids, dtype=torch.long)
                where = torch.tensor(early)[:, None], stops[None, :]
                if st.matcher is not None:  # kept for a grammar that may allow nothing but a stop (below)
                    held.update(zip(early, logits[where].clone()))
                logits[where] = float("-inf")
        if st.matcher is not None:
            m = masks.get(b) if masks else None
            if m is None:
                m, _ = walk(st.matcher, [], st.vocab_size, st.head)
            for n, j in zip(ns, js):
                masked_rows.append(n)
                mask_list.append(m[min(j, m.shape[0] - 1)])
    if masked_rows:
        stacked = torch.stack(mask_list)
        need = needs_mask(logits, stacked, masked_rows, [states[b_idx[n]].sp.greedy and n not in held
                                                        for n in masked_rows])
        if need is not None:
            apply_masks(logits, stacked[need], [masked_rows[i] for i in need.tolist()])
    if held:
        grammar_wins(logits, held, dict(zip(masked_rows, mask_list)), states, b_idx)
    return logits


def needs_mask(logits: torch.Tensor, masks: torch.Tensor, rows: list[int], greedy: list[bool]
               ) -> torch.Tensor | None:
    """Which of the slots ``rows`` (``masks[i]`` the grammar's mask of ``logits[rows[i]]``) must be masked: the
    indices into ``rows``, None for none. A greedy slot only feeds an argmax (``verify.accept_greedy``, the one-hot
    of ``sampling.target_probs``; logprobs are taken from the raw logits before ``process``), and where the
    unmasked argmax is a token the grammar allows, the masked argmax is that same token: it is the largest logit of
    all, so of the allowed ones too, and ``argmax`` takes the first of equal maxima, so an allowed tie at a lower id
    would have been the unmasked argmax. Such slots are left unmasked — the same token, without xgrammar's CPU
    kernel over the whole vocabulary (2.2 ms a call at 8 rows here, ~5 % of a schema job's round). Sampled slots
    (their whole distribution is read) and greedy slots whose argmax the grammar refuses are masked. ``greedy[i]``
    is False for a slot that must be masked whatever its argmax (a sampled row; one whose stops ``min_tokens`` holds
    back, which ``grammar_wins`` reads masked)."""
    cand = [i for i, g in enumerate(greedy) if g]
    if not cand:
        return torch.arange(len(rows))
    ci = torch.tensor(cand, dtype=torch.long)
    slots = torch.tensor([rows[i] for i in cand], dtype=torch.long, device=logits.device)
    peak, top = logits[slots].max(-1)  # the first of equal maxima, as ``argmax``
    best = peak.isfinite().cpu()  # a NaN or infinite maximum: masked as before, whatever it says
    top = top.cpu()
    allowed = ((masks[ci, top // 32] >> (top % 32)) & 1).bool()
    skip = set(ci[allowed & best].tolist())
    keep = [i for i in range(len(rows)) if i not in skip]
    return torch.tensor(keep, dtype=torch.long) if keep else None


def grammar_wins(logits: torch.Tensor, held: dict[int, torch.Tensor], masks: dict[int, torch.Tensor],
                 states: list[RowState | None], b_idx: list[int]) -> None:
    """``min_tokens`` against a grammar that allows nothing but a stop at this slot (a JSON record that has
    closed before ``min_tokens`` tokens): the grammar's end wins. The stop ids the grammar allows get back the
    logits ``min_tokens`` took from them (``held``: slot -> its stop ids' logits before), so the row ends with the
    stop the model prefers among those the grammar allows, and never with a token the grammar refuses. The batch
    tool refuses the combination up front instead (``dspine_batch.requests.fields``: both engines agree by
    never running it); this keeps a library caller's job alive. In place."""
    for n, before in held.items():
        if not bool((logits[n] == float("-inf")).all()):
            continue  # the grammar allows something else: min_tokens holds the stops back
        stops = states[b_idx[n]].sp.stop_token_ids
        words = masks[n]
        allowed = [i for i, t in enumerate(stops) if (int(words[t // 32]) >> (t % 32)) & 1]
        if allowed:
            logits[n, torch.tensor([stops[i] for i in allowed], dtype=torch.long)] = before[allowed]


@dataclass
class Logprobs:
    """The raw log-softmax facts of the slots whose rows asked for logprobs, taken before processing: the raw
    logits of those slots, their log-normaliser and top ids; ``take`` reads a committed token's entry."""

    where: dict[tuple[int, int], int]  # (batch row, slot) -> row in ``raw``
    raw: torch.Tensor  # [n, V]
    lse: torch.Tensor  # [n]
    top_ids: torch.Tensor  # [n, k]
    top_lp: torch.Tensor  # [n, k]

    @staticmethod
    def of(logits: torch.Tensor, states: list[RowState | None], b_idx: list[int], j_idx: list[int]
           ) -> Logprobs | None:
        sel = [n for n, b in enumerate(b_idx) if states[b] is not None and states[b].sp.logprobs is not None]
        if not sel:
            return None
        raw = logits[torch.tensor(sel, dtype=torch.long)].float()
        lse = torch.logsumexp(raw, -1)
        k = max(states[b_idx[n]].sp.logprobs or 0 for n in sel)
        top = raw.topk(k, dim=-1) if k else None
        return Logprobs({(b_idx[n], j_idx[n]): i for i, n in enumerate(sel)}, raw, lse,
                        top.indices if top is not None else torch.zeros(len(sel), 0, dtype=torch.long),
                        (top.values - lse[:, None]) if top is not None else torch.zeros(len(sel), 0))

    def take(self, b: int, j: int, token: int, k: int) -> tuple[int, float, list[tuple[int, float]]]:
        i = self.where[(b, j)]
        lp = float(self.raw[i, token] - self.lse[i])
        return token, lp, list(zip(self.top_ids[i, :k].tolist(), self.top_lp[i, :k].tolist()))
