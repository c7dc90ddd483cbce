"""A prefix cache for prompt prefill: a radix tree over prompt token ids holding what prefill computed for them.

Synthetic-data jobs repeat prompt prefixes: a long system prompt or few-shot template before every row, and the
``--num-samples`` siblings of one row, which share their whole prompt. Each node of the tree is a span of
tokens following its parent's, with what the target computed for that span in a batch-invariant prefill:

- per attention layer, the keys and values of the span (``[H_kv, n, D]`` each, the cache's dtype);
- the draft's taps of the span (``[n, n_taps * H]``) when a draft reads them, so its context is rebuilt exactly;
- at the span's end, when known: the recurrent state of every Gated-DeltaNet layer (hybrid targets) and the
  final hidden state of the span's last token (so a prompt cached whole needs no forward at all).

A lookup returns how many leading tokens of a prompt can be served: any matched length for a KV-only target,
the deepest matched node end with recurrent state for a hybrid (its state exists only where a prefill ended),
and at most ``len(prompt) - 1`` unless the whole prompt ends at a node with its final hidden state. Why copying
is exact: with the CPU kernels every prompt position's keys, values and hidden states depend only on the tokens
up to it, never on how many tokens or rows the forward held (``dspine.cpu.kernels``), and the GDN recurrence
runs token by token, so a row prefilled after a hit holds bit-identical state to one prefilled from scratch.
The decoder's tests prove it (sharing on vs off, dense and hybrid, greedy and sampled).

Memory is bounded by ``cap_bytes`` (what the stored tensors hold); least recently used leaves go first. Entries
are copied into a batch's cache on a hit, never referenced, so eviction can never touch a running row.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspine.models.cache import KVCache, ModelCache, SSMState

DEFAULT_CAP_MB = 512  # ~11k SmolLM2-135M prompt tokens with draft taps
MIN_SHARED = 16  # newcomers sharing fewer leading tokens than this are not worth a forward of their own


@dataclass(eq=False)
class _Node:
    tokens: list[int]
    parent: _Node | None
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)  # per layer, None for SSM
    taps: torch.Tensor | None = None  # [n, D_taps]
    state: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # per layer (conv, rec) at the end
    hidden: torch.Tensor | None = None  # [H] final hidden state of the span's last token
    children: dict[int, _Node] = field(default_factory=dict)
    used: int = 0
    nbytes: int = 0


@dataclass
class Hit:
    """What a lookup matched: ``length`` prompt tokens served by ``path`` (node, tokens used of it) in order,
    ``hidden`` the final hidden state of token ``length - 1`` when the whole prompt is served, else None."""

    length: int
    path: list[tuple[_Node, int]]
    hidden: torch.Tensor | None = None


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """The radix tree with LRU eviction under ``cap_bytes``. ``hybrid``: the target has recurrent layers (hits
    only at node ends with state). ``computed``/``served`` count prompt tokens prefilled and copied from here."""

    def __init__(self, cap_bytes: int = DEFAULT_CAP_MB << 20):
        if cap_bytes < 0:
            raise ValueError(f"prefix cache cap must be >= 0 bytes, got {cap_bytes}")
        self.cap_bytes = int(cap_bytes)
        self.root = _Node([], None, state=[])
        self.nbytes = 0
        self.peak_bytes = 0
        self.computed = 0
        self.served = 0
        self._clock = itertools.count(1)
        self._layout: tuple | None = None  # (layer kinds, taps width): entries from another layout never match
        self._owner: weakref.ref | None = None

    def __len__(self) -> int:
        return sum(1 for _ in self._nodes()) - 1

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        self.root = _Node([], None, state=[])
        self.nbytes = 0

    def bind(self, target: object, cache: ModelCache, taps: int) -> None:
        """Tie the tree to one model (``target``, held weakly) and cache layout (per-layer kind, dtype and
        shape; taps width): another one empties it, so an entry is only ever read by what wrote it."""
        layout = (tuple((type(x).__name__, x.k.dtype if isinstance(x, KVCache) else x.conv.dtype,
                         tuple(x.k.shape[1::2]) if isinstance(x, KVCache) else tuple(x.rec.shape[1:]))
                        for x in cache.layers), taps)
        owner = None if self._owner is None else self._owner()
        if layout != self._layout or owner is not target:
            self.clear()
            self._layout = layout
            self._owner = weakref.ref(target)

    @property
    def hybrid(self) -> bool:
        return self._layout is not None and any(kind == "SSMState" for kind, _, _ in self._layout[0])

    # -- lookup -------------------------------------------------------------------------------------------------
    def _walk(self, prompt: Sequence[int]) -> list[tuple[_Node, int]]:
        """The nodes ``prompt`` runs through from the root, each with how many of its tokens match (all but
        possibly the last: the walk stops inside the node where the prompt diverges or ends)."""
        path: list[tuple[_Node, int]] = []
        node, pos = self.root, 0
        while pos < len(prompt):
            child = node.children.get(prompt[pos])
            if child is None:
                break
            m = _lcp(child.tokens, prompt[pos : pos + len(child.tokens)])
            path.append((child, m))
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return path

    def match(self, prompt: Sequence[int]) -> int:
        """Leading tokens of ``prompt`` present in the tree (ignoring where state is kept); touches nothing."""
        return sum(m for _, m in self._walk(prompt))

    def lookup(self, prompt: Sequence[int], touch: bool = True) -> Hit:
        """The longest servable prefix of ``prompt`` (see the module docstring); marks its nodes used."""
        if self.cap_bytes == 0:
            return Hit(0, [])
        path = self._walk(prompt)
        pos = sum(m for _, m in path)
        # cut back to a point the row can continue from
        if not self.hybrid:  # any position; the whole prompt only with its last token's hidden state
            if path and pos == len(prompt):
                last, m = path[-1]
                if m < len(last.tokens) or last.hidden is None:
                    pos -= 1
                    path[-1:] = [] if m == 1 else [(last, m - 1)]
        else:  # a node end where a prefill ended (its recurrent state is known)
            while path:
                last, m = path[-1]
                if m == len(last.tokens) and last.state is not None and (pos < len(prompt) or last.hidden is not None):
                    break
                pos -= m
                path.pop()
        now = next(self._clock) if touch else -1
        for n, _ in path if touch else ():
            while n is not None and n.used != now:
                n.used = now
                n = n.parent
        hidden = None
        if path and pos == len(prompt):
            hidden = path[-1][0].hidden
        return Hit(pos, path, hidden)

    def load(self, hit: Hit, cache: ModelCache, row: int) -> torch.Tensor | None:
        """Write ``hit``'s keys/values (and, hybrid, the recurrent state at its end) into row ``row`` of ``cache``
        at positions ``0..hit.length-1``; set the row's length. Returns the hit's taps ``[length, D]`` (None if
        the tree keeps none)."""
        cache.lengths[row] = hit.length
        if not hit.path:
            return None
        pos = 0
        taps = []
        for node, m in hit.path:
            for layer, kv in zip(cache.layers, node.kv):
                if kv is not None:
                    layer.ensure(pos + m)
                    layer.k[row, :, pos : pos + m] = kv[0][:, :m]
                    layer.v[row, :, pos : pos + m] = kv[1][:, :m]
            if node.taps is not None:
                taps.append(node.taps[:m])
            pos += m
        end = hit.path[-1][0]
        if end.state is not None:
            for layer, st in zip(cache.layers, end.state):
                if st is not None:
                    layer.conv[row] = st[0]
                    layer.rec[row] = st[1]
        self.served += hit.length
        return torch.cat(taps) if taps else None

    # -- insert -------------------------------------------------------------------------------------------------
    def insert(self, prompt: Sequence[int], cache: ModelCache, row: int, taps: torch.Tensor | None,
               hidden: torch.Tensor) -> None:
        """Keep what row ``row`` of ``cache`` holds for ``prompt`` (just prefilled, ``cache.lengths[row] ==
        len(prompt)``): the keys/values of tokens not yet in the tree, ``taps`` ``[len(prompt), D]`` of them,
        and the state and final ``hidden`` [H] at the prompt's end. Evicts to stay under the cap."""
        if self.cap_bytes == 0 or not prompt:
            return
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(prompt):
            node.used = now
            child = node.children.get(prompt[pos])
            if child is None:
                break
            m = _lcp(child.tokens, prompt[pos : pos + len(child.tokens)])
            if m < len(child.tokens):
                child = self._split(child, m)
            node, pos = child, pos + m
        hybrid = any(isinstance(x, SSMState) for x in cache.layers)
        n = len(prompt) - pos
        per_token = sum(_nbytes(x.k[row, :, 0], x.v[row, :, 0]) for x in cache.layers if isinstance(x, KVCache))
        need = n * (per_token + (0 if taps is None else _nbytes(taps[0])))
        end_new = pos < len(prompt) or node.hidden is None
        if end_new:
            need += _nbytes(hidden) + (_nbytes(*(t for x in cache.layers if isinstance(x, SSMState)
                                                for t in (x.conv[row], x.rec[row]))) if hybrid else 0)
        self._evict(self.cap_bytes - need, keep=node)  # room first: the tree never holds more than the cap
        if self.nbytes + need > self.cap_bytes:
            return
        if pos < len(prompt):
            child = _Node(list(prompt[pos:]), node)
            for layer in cache.layers:
                if isinstance(layer, KVCache):
                    child.kv.append((layer.k[row, :, pos : len(prompt)].clone(),
                                     layer.v[row, :, pos : len(prompt)].clone()))
                else:
                    child.kv.append(None)
            child.taps = None if taps is None else taps[pos : len(prompt)].clone()
            child.nbytes = _nbytes(*(t for kv in child.kv if kv is not None for t in kv), child.taps)
            node.children[prompt[pos]] = child
            self.nbytes += child.nbytes
            node = child
        node.used = now
        if node.hidden is None:
            node.hidden = hidden.detach().clone()
            node.nbytes += _nbytes(node.hidden)
            self.nbytes += _nbytes(node.hidden)
        if node.state is None and hybrid:
            node.state = [(x.conv[row].clone(), x.rec[row].clone()) if isinstance(x, SSMState) else None
                          for x in cache.layers]
            b = _nbytes(*(t for s in node.state if s is not None for t in s))
            node.nbytes += b
            self.nbytes += b
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node`` after its first ``m`` tokens; returns the new upper node (no state or hidden at its end:
        no prefill ended there)."""
        upper = _Node(node.tokens[:m], node.parent, used=node.used)
        upper.kv = [None if kv is None else (kv[0][:, :m].clone(), kv[1][:, :m].clone()) for kv in node.kv]
        node.kv = [None if kv is None else (kv[0][:, m:].clone(), kv[1][:, m:].clone()) for kv in node.kv]
        if node.taps is not None:
            upper.taps, node.taps = node.taps[:m].clone(), node.taps[m:].clone()
        node.parent.children[node.tokens[0]] = upper
        node.tokens = node.tokens[m:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        before = node.nbytes
        upper.nbytes = _nbytes(*(t for kv in upper.kv if kv is not None for t in kv), upper.taps)
        node.nbytes = _nbytes(*(t for kv in node.kv if kv is not None for t in kv), node.taps, node.hidden,
                              *(t for s in (node.state or []) if s is not None for t in s))
        self.nbytes += upper.nbytes + node.nbytes - before
        return upper

    def _evict(self, budget: int, keep: _Node | None = None) -> None:
        """Drop least recently used leaves until the tree holds at most ``budget`` bytes, never ``keep`` or its
        ancestors (what is about to be extended)."""
        if self.nbytes <= budget:
            return
        protected = set()
        n = keep
        while n is not None:
            protected.add(id(n))
            n = n.parent
        pool = sorted((n for n in self._nodes() if not n.children and id(n) not in protected), key=lambda n: n.used)
        while pool and self.nbytes > budget:
            leaf = pool.pop(0)
            self._drop(leaf)
            parent = leaf.parent
            if not parent.children and id(parent) not in protected:  # now a leaf: it may go next, in its order
                pool.append(parent)
                pool.sort(key=lambda n: n.used)

    def _drop(self, node: _Node) -> None:
        del node.parent.children[node.tokens[0]]
        self.nbytes -= node.nbytes


def shared_prefixes(prompts: Sequence[Sequence[int]], tree: PrefixCache, min_len: int = MIN_SHARED
                    ) -> list[list[tuple[int, ...]]]:
    """The prefixes several of ``prompts`` share that the tree does not hold yet, in waves to prefill in order.

    Each prompt's candidate is its longest common prefix with any other prompt (its whole self for identical
    prompts: ``--num-samples`` siblings). Prefilling the candidates first, once each, lets every prompt then hit
    the tree. A wave holds candidates none of which extends another still to come, so a shorter shared prefix
    is computed once, before the longer ones that extend it. Candidates under ``min_len`` tokens are not
    worth a forward of their own, unless they are a whole prompt. For a hybrid target, a prompt that diverges
    inside a node adds the matched part as a candidate (see below)."""
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    best = [0] * len(prompts)
    for a, b in itertools.pairwise(order):
        n = _lcp(prompts[a], prompts[b])
        best[a], best[b] = max(best[a], n), max(best[b], n)
    want = {tuple(prompts[i][: best[i]]) for i in range(len(prompts))
            if (best[i] >= min_len or best[i] == len(prompts[i]) > 0) and tree.match(prompts[i][: best[i]]) < best[i]}
    if tree.hybrid:  # a prompt diverging inside a cached one: a prefill ending at the divergence gives the tree
        # the recurrent state there, so the rows after this one hit it (a system prompt's end, typically)
        for q in prompts:
            s = tree.match(q)
            if min_len <= s < len(q) and tree.lookup(q[:s], touch=False).length < s:
                want.add(tuple(q[:s]))
    want = sorted(want, key=len)
    waves: list[list[tuple[int, ...]]] = []
    while want:
        wave = [p for p in want if not any(len(q) < len(p) and p[: len(q)] == q for q in want)]
        waves.append(wave)
        want = [p for p in want if p not in set(wave)]
    return waves
