"""Shared test helpers, one module for every test file.

dspine_batch: run the CLI in-process (``run_cli``) or as a subprocess (``spawn``) with the deterministic scripted
engine put behind the default engine names through the engine registry (no environment switch in the
production path); write inputs and read outputs.

dspine: test doubles that follow the draft interface used by ``dspine.generate`` (see dspine/draft.py).

They let the decoding loop be tested for losslessness independently of the real DSpine draft:
- ``ScriptedDraft`` proposes a known continuation (the target's own greedy output) with optional injected
  mistakes, so every accept length 0..bs-1 is exercised, and τ = bs when no mistake is injected;
- ``RandomDraft`` proposes from a random, row-and-position-dependent distribution q (stochastic proposals
  with a real q), or deterministically (one-hot q);
- ``LookaheadDraft`` (negative control) truncates after seeing its own later samples, which is NOT lossless.
The row identity rides in a one-element "KV" tensor so ``ModelCache.select`` keeps it aligned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.dataset as ds
import torch

from dspine.cache import KVCache, ModelCache
from dspine_batch.cli import main
from dspine_batch.engine import engines_replaced
from dspine_batch.keyset import fallback_id_hashes, key_hash
from dspine_batch.scripted_engine import ScriptedEngine

# -- dspine_batch -------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("latency_s", "attempt")  # differ between runs by design


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] | None = None) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines or []:
            f.write(line + b"\n")
    return path


def prompts(n: int, start: int = 0) -> list[dict]:
    kinds = ["Explain {i} in one line.", "def f{i}(x): return x *", "What is {i} + {i}?", "Tell a story #{i}"]
    return [{"id": f"r{i:05d}", "prompt": kinds[i % 4].format(i=i)} for i in range(start, start + n)]


def scripted_engine(model: str, draft: str, engine_args: dict[str, str]) -> ScriptedEngine:
    """Engine loader: the deterministic scripted engine, whatever model was asked for."""
    return ScriptedEngine.from_args(engine_args)


def run_cli(args: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``dspine-batch`` in-process with the scripted engine behind ``auto``/``reference``; returns the exit
    code."""
    old = dict(os.environ)
    os.environ.update({"DSPINE_BATCH_PROGRESS": "none", **(env or {})})
    try:
        with engines_replaced(scripted_engine):
            main(args)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return 0


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPINE_BATCH_")}
    env.update({"DSPINE_BATCH_PROGRESS": "none", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")},
               **extra)
    return env


def spawn(args: list[str], cwd: Path = ROOT, **extra_env: str) -> subprocess.Popen:
    """``dspine-batch ARGS`` as a subprocess on the scripted engine (through ``tests/scripted_cli.py``)."""
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripted_cli.py"), *args],
                            env=subprocess_env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)


def shard_of(row_id: str, n: int, id_column: bool = True) -> int:
    """The shard that owns ``row_id``, computed the way the pipeline selects rows. Runs without an id column
    hash ``<file>:<index>`` ids by index (``keyset.index_hashes``), so pass ``id_column=False`` for them."""
    if id_column:
        return key_hash(row_id) % n
    return int(fallback_id_hashes([row_id])[0]) % n


def read_output(outdir: Path, drop: tuple[str, ...] = VOLATILE) -> list[dict]:
    t = ds.dataset(str(outdir), format="parquet").to_table()
    rows = [{k: v for k, v in r.items() if k not in drop} for r in t.to_pylist()]
    return sorted(rows, key=lambda r: (r["row_id"], r["sample_index"]))


# -- dspine: draft test doubles -----------------------------------------------------------------------------------
@dataclass
class Proposal:
    tokens: torch.Tensor
    q: torch.Tensor | None
    n_draft: torch.Tensor
    confidence: torch.Tensor | None = None


class _FakeBase:
    target_layer_ids = [0]

    def __init__(self, block_size: int = 4):
        self.block_size = block_size
        self.calls = 0

    def new_cache(self, batch, capacity):
        rid = torch.arange(batch, dtype=torch.float32).view(batch, 1, 1, 1)
        return ModelCache(torch.zeros(batch, dtype=torch.long), [KVCache(rid, rid.clone())])

    def extend_context(self, cache, taps, n_valid):
        cache.lengths += n_valid.to(cache.lengths)

    @staticmethod
    def rows(cache) -> list[int]:
        return [int(x) for x in cache.layers[0].k.view(-1)]


class ScriptedDraft(_FakeBase):
    """Proposes ``script[row][start - prompt_len + 1 : ...]``; ``mistake(row, start, j)`` flips slot j."""

    def __init__(self, prompts, script, block_size=4, mistake=None, vocab=256):
        super().__init__(block_size)
        self.prompts, self.script, self.mistake, self.vocab = prompts, script, mistake, vocab

    def propose(self, cache, anchor, target, temperature, generators, block_size=None, dynamic_threshold=None):
        bs = block_size or self.block_size
        out = torch.zeros(len(anchor), bs - 1, dtype=torch.long)
        nd = torch.full((len(anchor),), bs - 1, dtype=torch.long)
        for b, row in enumerate(self.rows(cache)):
            start = int(cache.lengths[b])
            g0 = start - len(self.prompts[row]) + 1  # index in the generated script of slot 1
            for j in range(bs - 1):
                k = g0 + j
                tok = self.script[row][k] if k < len(self.script[row]) else 0
                if self.mistake is not None and self.mistake(row, start, j):
                    tok = (tok + 1) % self.vocab
                out[b, j] = tok
            if dynamic_threshold is not None:  # a stopping rule that only looks at the past: (row, start)
                nd[b] = (row * 7 + start) % bs
        self.calls += 1
        return Proposal(out, None, nd)


class RandomDraft(_FakeBase):
    """Stochastic proposals from q = softmax(sharp random logits) seeded by (row content, position)."""

    def __init__(self, vocab, block_size=4, stochastic=True, sharp=2.0, dynamic=False):
        super().__init__(block_size)
        self.vocab, self.stochastic, self.sharp, self.dynamic = vocab, stochastic, sharp, dynamic

    def _q(self, start: int, j: int, prev: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000003 * start + 7919 * j + prev)
        return (torch.randn(self.vocab, generator=g) * self.sharp).softmax(-1)

    def propose(self, cache, anchor, target, temperature, generators, block_size=None, dynamic_threshold=None):
        bs = block_size or self.block_size
        B = len(anchor)
        toks = torch.zeros(B, bs - 1, dtype=torch.long)
        q = torch.zeros(B, bs - 1, self.vocab)
        nd = torch.full((B,), bs - 1, dtype=torch.long)
        for b in range(B):
            start, prev = int(cache.lengths[b]), int(anchor[b])
            sampled = float(temperature[b]) > 0 and self.stochastic
            u = torch.rand(bs - 1, generator=generators[b]) if sampled else None
            for j in range(bs - 1):
                qj = self._q(start, j, prev)
                if sampled:
                    tok = int(
                        torch.searchsorted(qj.cumsum(0), u[j : j + 1] * qj.sum(), right=True).clamp(max=self.vocab - 1)
                    )
                    q[b, j] = qj
                else:
                    tok = int(qj.argmax())
                    q[b, j] = torch.nn.functional.one_hot(torch.tensor(tok), self.vocab).float()
                toks[b, j] = tok
                if self.dynamic and j >= 1 and float(qj.max()) < 0.2 and nd[b] == bs - 1:
                    nd[b] = j  # stop decided from F_{j}: q_{j+1} depends only on the past
                prev = tok
        return Proposal(toks, q, nd)


class LookaheadDraft(RandomDraft):
    """NOT lossless: drafts a full block, then cuts before the first proposal that is not q's mode."""

    def propose(self, cache, anchor, target, temperature, generators, block_size=None, dynamic_threshold=None):
        prop = super().propose(cache, anchor, target, temperature, generators, block_size)
        for b in range(len(anchor)):
            for j in range(prop.tokens.shape[1]):
                if int(prop.q[b, j].argmax()) != int(prop.tokens[b, j]):
                    prop.n_draft[b] = j
                    break
        return prop
