"""Shared test helpers, one module for every test file.

dspine_batch: run the CLI in-process (``run_cli``) or as a subprocess (``spawn``) with the deterministic scripted
engine put behind the default engine names through the engine registry (no environment switch in the
production path); write inputs and read outputs.

dspine: test doubles that follow the draft interface used by ``dspine.generate`` (see dspine/draft/model.py).

They let the decoding loop be tested for losslessness independently of the real DSpine draft:
- ``ScriptedDraft`` proposes a known continuation (the target's own greedy output) with optional injected
  mistakes, so every accept length 0..bs-1 is exercised, and τ = bs when no mistake is injected;
- ``RandomDraft`` proposes from a random, row-and-position-dependent distribution q (stochastic proposals
  with a real q), or deterministically (one-hot q);
- ``LookaheadDraft`` (negative control) truncates after seeing its own later samples, which is NOT lossless.
The row identity rides in a one-element "KV" tensor so ``ModelCache.select`` keeps it aligned.
``JoiningScriptedDraft`` is ``ScriptedDraft`` for continuous batching; ``token_prompts`` and ``random_mistakes``
make the prompts and injected mistakes for them.

Tiny models: ``save_tiny_hf`` (Llama / Qwen3) and ``save_tiny_qwen35`` (the Qwen3.5 hybrid) saved by transformers
(the oracle) and loaded by dspine; the draft shapes of tests/draft/test_draft.py (``make_draft``, ``fill_context``) and
tests/training/test_train.py (``TRAIN_*``, ``train_stats``); the tiny reference-engine checkpoint with a tokenizer
(``tokenizer_dir``, ``save_tiny_engine_pair``, ``reference_engine``, ``chat_requests``); the SGLang end-to-end
checkpoints and engine runner (``random_pair``, ``constant_pair``, ``hybrid_pair``,
``alternating_hybrid_pair``, ``run_engine``).

Only cheap imports at module level: the SGLang tests import this module under the SGLang virtual environment, so
transformers, tokenizers and the like are imported inside the functions that need them. Fixtures live in
tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import torch
from scripted_cli import scripted_engine  # the subprocess entry point's loader (lean: no torch)

from dspine.models.cache import KVCache, ModelCache
from dspine_batch.cli import main
from dspine_batch.engines.base import Request, SamplingParams
from dspine_batch.engines.registry import engines_replaced
from dspine_batch.outdir.keyset import fallback_id_hashes, key_hash

# -- dspine_batch -------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("latency_s", "attempt", "cached_prompt_tokens")  # differ between runs by design (a resumed engine
# starts with an empty prefix cache)


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


def map_rows(mapper: Any, files: list, columns: Any) -> list:
    """Every input row through a ``RowMapper`` as the pipeline does it (ids first, then the work item)."""
    from dspine_batch.inputs.sources import iter_inputs

    out = []
    for b in iter_inputs(files, columns.read_columns()):
        ids, problems, _ = mapper.assign_ids(b)
        out += [mapper.build(i, b.file, idx, r, p) for i, idx, r, p in zip(ids, b.indices, b.rows, problems,
                                                                            strict=True)]
    return out


def run_cli(args: list[str], env: dict[str, str] | None = None, loader: Callable = scripted_engine) -> int:
    """Run ``dspine-batch`` in-process with the scripted engine (or ``loader``) behind ``auto``/``reference``;
    returns the exit code."""
    old = dict(os.environ)
    os.environ.update({"DSPINE_BATCH_PROGRESS": "none", **(env or {})})
    try:
        with engines_replaced(loader):
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


def run_shards(args: list[str], shards: int, **extra_env: str) -> None:
    """``dspine-batch ARGS --shard i/shards`` for every shard at once, each in its own process (as an array's tasks
    run); every one must exit 0."""
    procs = [spawn([*args, "--shard", f"{i}/{shards}"], **extra_env) for i in range(shards)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()


def kill9_resumes(args: list[str], out: Path, rng: random.Random, tries: int, early: float, late: float,
                  enough: int | None = None) -> tuple[int, int, list[str]]:
    """``dspine-batch ARGS`` (writing to ``out``) killed -9 at random moments and started again, up to ``tries``
    times (or ``enough`` kills), then run to its end, which must succeed. The moments are calibrated to this
    machine: the first start is killed at its first commit, later ones after ``early`` x that time up to that time
    + ``late`` seconds. Returns (kills, kills after some part was committed, each start's stderr)."""
    from dspine_batch.outdir.output import list_parts

    p = spawn(args)
    t0 = time.monotonic()
    while not (out.exists() and list_parts(str(out))) and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    first_commit = time.monotonic() - t0
    p.kill()
    p.communicate()
    kills, mid_run, logs = 0, 0, []
    for _ in range(tries):
        p = spawn(args)
        time.sleep(rng.uniform(early * first_commit, first_commit + late))
        if p.poll() is None:
            p.kill()
            kills += 1
        _, err = p.communicate()
        assert p.returncode in (0, -signal.SIGKILL), (p.returncode, err.decode())
        logs.append(err.decode())
        if out.exists() and list_parts(str(out)) and p.returncode != 0:
            mid_run += 1
        if p.returncode == 0 or (enough is not None and kills >= enough):
            break
    p = spawn(args)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    logs.append(err.decode())
    return kills, mid_run, logs


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


class JoiningScriptedDraft(ScriptedDraft):
    """``ScriptedDraft`` for continuous batching: each ``new_cache`` call numbers its rows after the previous
    ones, so a row keeps its request index when it is prefilled late and written into a freed slot (requests
    are prefilled in input order). Never let a calibration call ``new_cache`` on it: pass a cost model."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.next_row = 0

    def new_cache(self, batch, capacity):
        rid = torch.arange(self.next_row, self.next_row + batch, dtype=torch.float32).view(batch, 1, 1, 1)
        self.next_row += batch
        return ModelCache(torch.zeros(batch, dtype=torch.long), [KVCache(rid, rid.clone())])


def token_prompts(n: int, vocab: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    """``n`` random token-id prompts of random lengths in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def random_mistakes(seed: int, rate: float):
    """A ``ScriptedDraft`` ``mistake`` rule: flips each (row, start, slot) with probability ``rate``."""

    def f(row, start, j):
        return random.Random(hash((seed, row, start, j))).random() < rate

    return f


# -- tiny models saved by transformers (the oracle) and loaded by dspine -----------------------------------------
TINY_VOCAB, TINY_HIDDEN = 256, 64


def save_tiny_hf(
    path,
    family: str = "llama",
    vocab: int = 256,
    layers: int = 3,
    seed: int = 0,
    head_scale: float | None = None,
    gguf: bool = False,
    **kw,
) -> str:
    """Save a tiny random HF model (LlamaForCausalLM / Qwen3ForCausalLM) to ``path``; returns the path. ``gguf``: its
    weights on GGUF block grids (``to_gguf_grids``)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    common.update(kw)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{"tie_word_embeddings": True, **common}))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**{"head_dim": 16, "tie_word_embeddings": False, **common})
        )
    else:
        raise ValueError(family)
    # random init is small; scale the head so the distributions are peaked enough to be interesting
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale or (3.0 if family == "llama" else 25.0))
        if gguf:
            to_gguf_grids(model)
    model.save_pretrained(str(path))
    return str(path)


def to_gguf_grids(model: torch.nn.Module) -> None:
    """Every 2-D weight with a multiple of 32 columns moved onto the grid a GGUF converter gives it (in place): Q8_0
    for embeddings and heads, Q4_1 for the rest, as the embedded SmolLM2 is (so our kernels keep them as blocks).
    Q4_1: per 32 columns m = the block minimum and d = (max - min) / 15, both float16, q forced to 0 and 15 at the
    block's first two columns; Q8_0: d = max|w| / 127 as float16, q = 127 at the first column."""
    for name, w in model.named_parameters():
        if w.dim() != 2 or w.shape[1] % 32:
            continue
        n, k = w.shape
        b = w.detach().float().reshape(n, k // 32, 32)
        if "embed" in name or "lm_head" in name:
            d = (b.abs().amax(-1) / 127).clamp_min(1e-4).half().float()[..., None]
            q = (b / d).round().clamp(-127, 127)
            q[..., 0] = 127
            w.copy_((d * q).reshape(n, k))
        else:
            m = b.amin(-1).half().float()[..., None]
            d = ((b.amax(-1, keepdim=True) - m) / 15).clamp_min(1e-4).half().float()
            q = ((b - m) / d).round().clamp(0, 15)
            q[..., 0], q[..., 1] = 0, 15
            w.copy_((d * q + m).reshape(n, k))


# Qwen3.5 hybrid: 4 layers (GDN, full, GDN, full), hidden 64, vocab 256, 2 key / 4 value GDN heads (so the key-head
# sharing is exercised), partial RoPE 0.25.
QWEN35_VOCAB = 256
QWEN35_TEXT = dict(
    vocab_size=QWEN35_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    full_attention_interval=2,
    max_position_embeddings=1024,
)


def randomize_qwen35(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Re-randomise at a larger scale than HF's init (norm weights, decays, conv) so every component moves the
    logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates A in [0.05, 2): long enough memory to test state carry
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("linear_attn.norm.weight"):  # plain weight (init 1)
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # zero-centred (1 + w) weights
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def save_tiny_qwen35(path, seed: int = 0, vlm: bool = False, tie: bool = False, **kw) -> str:
    """Save a tiny random ``Qwen3_5ForCausalLM`` (or ``Qwen3_5ForConditionalGeneration`` with ``vlm``)."""
    import transformers

    V = QWEN35_VOCAB
    text = {**QWEN35_TEXT, **kw}
    text.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    if vlm:
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        cfg = transformers.Qwen3_5Config(
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=tie,
            image_token_id=V - 4,
            video_token_id=V - 3,
            vision_start_token_id=V - 2,
            vision_end_token_id=V - 1,
        )
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(tie_word_embeddings=tie, **text))
    randomize_qwen35(model.eval(), seed)
    model.save_pretrained(str(path))
    return str(path)


# -- the draft shape of tests/draft/test_draft.py (also tests/sglang_plugin/test_sglang_math.py) ------------------
DRAFT_BS = 8
DRAFT_KW = dict(num_layers=3, block_size=DRAFT_BS, transfer_rank=16, message_size=32, top_k=4, intermediate_size=96)
DRAFT_VOCAB = list(range(0, TINY_VOCAB, 3))  # a draft vocabulary: 86 of 256 ids


def save_hf_init_qwen3(path, layers=4, tied=False):
    """A tiny Qwen3 (hidden 64, vocab 256) with transformers' own random init, saved to ``path``."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=512,
        tie_word_embeddings=tied, rope_theta=10000.0,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@torch.no_grad()
def randomize_draft(draft, seed: int = 1, backbone_std: float = 0.08, inj_std: float = 0.3):
    """Stronger random weights than init (non-zero writes/G_pred) so every path actually moves the output."""
    g = torch.Generator().manual_seed(seed)
    for name, p in draft.named_parameters():
        if name.startswith("injection.readouts"):
            continue  # keep D^T
        if name.startswith("injection."):
            p.normal_(0.0, 0.1 if name == "injection.bias" else inj_std, generator=g)
        elif name.startswith("confidence_head."):
            p.normal_(0.0, 0.3, generator=g)
        elif p.dim() == 2:
            p.normal_(0.0, backbone_std, generator=g)
        else:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return draft


def make_draft(target, random_writes=True, seed=0, **kw):
    """A ``DRAFT_KW`` draft for ``target`` (``**kw`` overrides), randomised by ``randomize_draft`` unless not
    ``random_writes``."""
    from dspine.draft.io import init_draft

    draft = init_draft(target, seed=seed, **{**DRAFT_KW, **kw})
    return randomize_draft(draft, seed + 1) if random_writes else draft


def fill_context(draft, lengths, seed=0, cap=64):
    """A cache holding random context rows (taps) of the given per-row lengths, in one call."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    taps = torch.randn(B, T, draft.fc.in_features, generator=g)
    cache = draft.new_cache(B, cap)
    draft.extend_context(cache, taps, torch.tensor(lengths))
    return cache, taps


# -- the tiny peaky Qwen3 target and draft shape of tests/training/test_train.py (also test_confidence.py) --------
TRAIN_BS = 6
TRAIN_DRAFT_KW = dict(num_layers=2, block_size=TRAIN_BS, transfer_rank=16, message_size=32, top_k=4,
                      intermediate_size=96)


def save_train_qwen3(path):
    """A tiny tied Qwen3 (hidden 64, vocab 256, 4 layers) with transformers' init, saved to ``path``."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def load_train_target(path):
    """``save_train_qwen3``'s model loaded by dspine, with peaky teacher distributions."""
    from dspine.models.registry import load_target

    t = load_target(path)
    with torch.no_grad():
        t.embed_tokens.weight.mul_(8.0)  # peaky teacher distributions: a random head is near uniform otherwise
    return t


@torch.no_grad()
def randomize_train_draft(draft, seed: int = 1):
    """Non-zero injection writes and G_pred, so the parity test covers every path (init has them at zero)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in draft.named_parameters():
        if name.startswith("injection.") and not name.startswith("injection.readouts"):
            p.normal_(0.0, 0.1 if name == "injection.bias" else 0.3, generator=g)
        elif p.dim() == 2 and not name.startswith("injection.readouts"):
            p.normal_(0.0, 0.08, generator=g)
    return draft


def train_stats(draft, target, batch, cfg) -> list[dict]:
    """``cfg.steps`` AdamW steps of ``train_step`` on one fixed batch; its stats per step."""
    from dspine.training.train import train_step

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)
    stats = []
    for step in range(cfg.steps):
        opt.zero_grad()
        stats.append(train_step(draft, target, batch, step, cfg, gen))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return stats


# -- a tiny checkpoint with a tokenizer for the reference engine (and the Slurm / SGLang CLI runs) ----------------
SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOKENIZER_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def tokenizer_dir(path, template):
    """Train a tiny byte-level BPE tokenizer with ``template`` as its chat template into ``path``; returns its
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=TOKENIZER_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, what is two plus two? the answer is four. café ünïcode"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": template}))
    return tok.get_vocab_size()


def save_tiny_engine_pair(model_dir: Path, draft_dir: Path) -> tuple[Path, Path]:
    """A tiny random Llama target with a tokenizer in ``model_dir``, and a random DSpine draft for it in
    ``draft_dir``."""
    from dspine import init_draft, load_target

    vocab = tokenizer_dir(model_dir, SMOL_TEMPLATE)
    save_tiny_hf(model_dir, "llama", vocab=vocab, layers=2, max_position_embeddings=96)
    torch.manual_seed(0)
    init_draft(load_target(model_dir), num_layers=1, block_size=4).save(draft_dir)
    return model_dir, draft_dir


def reference_engine(tiny, draft=True, **args):
    """The reference engine on ``tiny`` (a ``save_tiny_engine_pair`` pair), with or without its draft."""
    from dspine_batch.engines.reference import ReferenceEngine

    model, draft_dir = tiny
    return ReferenceEngine.load(str(model), str(draft_dir) if draft else "none", args)


def chat_requests(engine, n=4, **p):
    """``n`` short chat requests, 5 new tokens each, ``**p`` more sampling parameters."""
    texts = ["hello world", "what is two plus two?", "the answer", "café", "four"]
    return [Request(f"r{i}", 0, engine.tokenizer.render_chat([{"role": "user", "content": texts[i % 5]}]),
                    SamplingParams(max_new_tokens=5, stop_token_ids=engine.tokenizer.stop_token_ids([]), **p))
            for i in range(n)]


def teacher_forced_batch(target, draft, length: int, lo: int = 0, n: int = 2, seed: int = 2) -> list:
    """``n`` random texts of ``length`` tokens in [lo, 255) the target never wrote, as teacher-forced training
    examples (8-token prompts) with the target's captured features: what a draft-training test trains on."""
    from dspine.training.train import capture, make_example

    g = torch.Generator().manual_seed(seed)
    texts = [torch.randint(lo, 255, (length,), generator=g).tolist() for _ in range(n)]
    exs = [make_example(t[:8], t[8:], teacher_forced=True) for t in texts]
    return [(ex, capture(target, ex.ids, draft.target_layer_ids, greedy=True)) for ex in exs]


def grouped_requests(engine, groups: dict[str, dict], n: int = 2) -> list:
    """``chat_requests`` per group, each with the group's sampling settings over it and its row ids prefixed by the
    group's name (``lp-r0``): one batch mixing logprobs, structures, penalties ..."""
    reqs = []
    for name, p in groups.items():
        for r in chat_requests(engine, n=n):
            r.row_id = f"{name}-{r.row_id}"
            r.params = replace(r.params, **p)
            reqs.append(r)
    return reqs


# -- SGLang end to end on a CPU (tests/sglang_plugin/test_sglang_e2e.py, tests/cli/test_sglang_cli.py) -------------
# * ``random_pair``: a random Qwen3 target and a random DSpine draft whose injection weights are non-zero, so the
#   injection after every layer and the last-write refinement of the transition cache really change proposals
#   (a fresh ``init_draft`` has zero writes: exactly the causal DFlash backbone).
# * ``constant_pair``: a target whose greedy next token is the same token X whatever the context (every
#   embedding row is one shared direction plus a little noise, the decoder layers are damped, so the final
#   state always points the same way) and a draft built the same way, which therefore proposes X at every slot:
#   most rounds accept every draft (tau close to the block width), with non-zero injection weights too.
# * ``hybrid_pair`` / ``alternating_hybrid_pair``: the same for a Qwen3.5 hybrid target (GDN + full attention);
#   the alternating one makes verify rounds accept part of a block (see its docstring).
# * ``run_engine``: start ``sglang.Engine`` (CPU test path without a GPU, CUDA with graphs on a GPU), run a
#   workload, shut it down killing only the processes it started (``Engine.shutdown`` would kill every child of
#   the test process).

SGLANG_BLOCK = 4
CONSTANT_TOKEN = 42
COMMON_KWARGS = dict(tp_size=1, dtype="float32", max_total_tokens=4096, max_running_requests=8,
                     mem_fraction_static=0.5, skip_tokenizer_init=True, log_level="error")
# Without a GPU: SGLang's CPU test path (dspine.sglang.cpu). With one (scripts/gpu/gpu_check.sh --sglang), the same
# tests run on CUDA with CUDA graphs on; triton attention because it takes the fp32 tiny models.
GPU_ENGINE_KWARGS = dict(device="cuda", attention_backend="triton", disable_cuda_graph=False, cuda_graph_max_bs=8)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def engine_kwargs() -> dict:
    from dspine_batch.engines.sglang.args import cpu_defaults

    return {**COMMON_KWARGS, **(GPU_ENGINE_KWARGS if on_gpu() else cpu_defaults(speculative=False))}


def save_random_draft(target_dir: str, out: Path, seed: int, damp: float | None = None):
    """A 2-layer DSpine draft for ``target_dir`` with random non-zero injection weights (all residual writes
    scaled by ``damp`` when given), saved to ``out``; returns the loaded target."""
    from dspine import load_target
    from dspine.draft.io import init_draft

    target = load_target(target_dir)
    draft = init_draft(target, num_layers=2, block_size=SGLANG_BLOCK, transfer_rank=8, message_size=16, top_k=4,
                       intermediate_size=64, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        inj = draft.injection
        for w in inj.writes:
            w.weight.copy_(torch.randn(w.weight.shape, generator=g) * 0.5)
        inj.predecessor_gate.weight.copy_(torch.randn(inj.predecessor_gate.weight.shape, generator=g) * 0.5)
        if damp is not None:
            for name, p in draft.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(damp)
            for w in inj.writes:
                w.weight.mul_(damp)
    draft.save(out)
    return target


def chat_pair(target_dir: Path, draft_dir: Path) -> tuple[str, str]:
    """A tiny Qwen3 target with a real tokenizer and SmolLM2's chat template (what the CLI renders prompts with),
    and a random draft for it: the SGLang tests' model pair."""
    vocab = tokenizer_dir(target_dir, SMOL_TEMPLATE)
    save_tiny_hf(target_dir, "qwen3", vocab=vocab, layers=3, max_position_embeddings=4096)
    save_random_draft(str(target_dir), draft_dir, seed=3)
    return str(target_dir), str(draft_dir)


def random_pair(root: Path) -> tuple[str, str]:
    tdir = save_tiny_hf(root / "target", "qwen3", vocab=256, layers=3, max_position_embeddings=4096)
    save_random_draft(tdir, root / "draft", seed=3)
    return tdir, str(root / "draft")


def constant_pair(root: Path) -> tuple[str, str]:
    from safetensors.torch import load_file, save_file

    tdir = save_tiny_hf(root / "target", "qwen3", vocab=256, layers=3, max_position_embeddings=4096, seed=1)
    path = Path(tdir) / "model.safetensors"
    sd = load_file(path)
    g = torch.Generator().manual_seed(7)
    emb = sd["model.embed_tokens.weight"]
    shared = torch.randn(emb.shape[1], generator=g)
    sd["model.embed_tokens.weight"] = shared + 0.05 * torch.randn(emb.shape, generator=g)
    head = sd["lm_head.weight"].clone()
    head[CONSTANT_TOKEN] = shared / shared.norm() * 50  # X wins by a wide margin wherever the state points
    sd["lm_head.weight"] = head
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = sd[k] * 0.05
    save_file(sd, str(path), metadata={"format": "pt"})
    save_random_draft(tdir, root / "draft", seed=5, damp=0.05)
    return tdir, str(root / "draft")


def save_sglang_qwen35(path, **kw) -> str:
    """``save_tiny_qwen35`` for SGLang, whose Qwen3.5 config reads the layer pattern from ``full_attention_interval``
    (transformers saves only ``layer_types``; real checkpoints carry both)."""
    tdir = save_tiny_qwen35(path, max_position_embeddings=4096, **kw)
    cfg_path = Path(tdir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["full_attention_interval"] = QWEN35_TEXT["full_attention_interval"]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return tdir


def hybrid_pair(root: Path) -> tuple[str, str]:
    """A random Qwen3.5 hybrid target (GDN, full, GDN, full) and a random DSpine draft for it."""
    tdir = save_sglang_qwen35(root / "target", seed=2)
    save_random_draft(tdir, root / "draft", seed=3)
    return tdir, str(root / "draft")


def alternating_hybrid_pair(root: Path) -> tuple[str, str]:
    """A hybrid target whose greedy continuation alternates X Y X Y ... and a draft that proposes X everywhere.

    Every embedding row is one shared direction s plus a little noise, except X's, which is s plus an equal
    orthogonal part u; the decoder layers are damped and the final norm is plain, so the final state points
    along the current token's embedding. Head rows: X along s, Y slightly less along s plus along u, so Y wins
    only after X. The draft (damped, built the same way as ``constant_pair``'s) proposes X at every slot: a round
    anchored on Y accepts its first draft and rejects the second, so verify rounds commit partial blocks and
    the GDN state of the rejected drafts must be rolled back (ReplaySSM).
    """
    from safetensors.torch import load_file, save_file

    tdir = save_sglang_qwen35(root / "target", seed=4)
    path = Path(tdir) / "model.safetensors"
    sd = load_file(path)
    g = torch.Generator().manual_seed(11)
    emb = sd["model.embed_tokens.weight"]
    shared = torch.randn(emb.shape[1], generator=g)
    u = torch.randn(emb.shape[1], generator=g)
    u = u - (u @ shared) / (shared @ shared) * shared
    u = u / u.norm() * shared.norm()
    emb = shared + 0.05 * torch.randn(emb.shape, generator=g)
    emb[ALTERNATING[0]] = shared + u
    sd["model.embed_tokens.weight"] = emb
    head = sd["lm_head.weight"].clone()
    s_hat, u_hat = shared / shared.norm(), u / u.norm()
    head[ALTERNATING[0]] = 50 * s_hat
    head[ALTERNATING[1]] = 45 * s_hat + 30 * u_hat
    sd["lm_head.weight"] = head
    sd["model.norm.weight"] = torch.zeros_like(sd["model.norm.weight"])
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            sd[k] = sd[k] * 0.05
    save_file(sd, str(path), metadata={"format": "pt"})
    save_random_draft(tdir, root / "draft", seed=5, damp=0.05)
    return tdir, str(root / "draft")


ALTERNATING = (42, 77)  # (X, Y) of ``alternating_hybrid_pair``


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def run_engine(model: str, workload: Callable[[Any], Any], draft: str | None = None, env: dict | None = None,
               **kwargs) -> Any:
    """Start an engine (DSPINE when ``draft`` is given), return ``workload(engine)``, shut the engine down."""
    import sglang

    from dspine.sglang import plugin
    from dspine_batch.engines.sglang.processes import scoped_shutdown, zmq_contexts

    plugin.register()
    kw = {**engine_kwargs(), "model_path": model, **kwargs}
    if draft is not None:
        kw.update(speculative_algorithm="DSPINE", speculative_draft_model_path=draft,
                  speculative_num_draft_tokens=SGLANG_BLOCK,
                  speculative_draft_attention_backend=kw["attention_backend"])
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    before = _child_pids()
    contexts = zmq_contexts()
    try:
        engine = sglang.Engine(**kw)
    except BaseException:  # a refused start: its processes, and the contexts its tokenizer manager made, go now
        from dspine_batch.engines.sglang.processes import close_contexts, kill_owned

        kill_owned(_child_pids() - before)
        close_contexts(contexts)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        return workload(engine)
    finally:
        scoped_shutdown(engine, _child_pids() - before, contexts)


def cache_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, window: int = 0
                    ) -> torch.Tensor:
    """torch's fp32 softmax attention of q [B, T, Hq, D] over caches [B, Hkv, cap, D] (any float dtype, read as
    fp32): query (b, t) sees slots <= pos[b, t] (and > pos - window) -> [B, T, Hq * D]. What our attention kernels
    are checked against."""
    B, T, Hq, D = q.shape
    Hkv, cap = kc.shape[1], kc.shape[2]
    keys, values = kc.float().repeat_interleave(Hq // Hkv, 1), vc.float().repeat_interleave(Hq // Hkv, 1)
    j = torch.arange(cap)
    mask = j[None, None, :] <= pos[:, :, None]
    if window:
        mask &= j[None, None, :] > pos[:, :, None] - window
    scores = torch.einsum("bthd,bhsd->bhts", q, keys) * D**-0.5
    out = torch.einsum("bhts,bhsd->bthd", scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1), values)
    return out.reshape(B, T, Hq * D)


# -- exact laws and random drafts for χ² tests (decoding and model families) -------------------------------------
def exact_joint3(target, prompt: list[int]) -> torch.Tensor:
    """Exact p(x1, x2, x3 | prompt) at temperature 1 (small vocab: enumerate x1, x2)."""
    V = target.vocab_size
    p1 = target.score(torch.tensor([prompt]))[0, -1].softmax(-1)
    p2 = target.score(torch.tensor([prompt + [x] for x in range(V)]))[:, -1].softmax(-1)
    p3 = target.score(torch.tensor([prompt + [x, y] for x in range(V) for y in range(V)]))[:, -1].softmax(-1)
    return (p1[:, None, None] * p2[:, :, None] * p3.view(V, V, V)).flatten().double()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson χ² p-value of ``counts`` against ``probs``, cells with expected count < 5 pooled into one."""
    from scipy.stats import chisquare

    exp = probs * counts.sum()
    order = exp.argsort(descending=True)
    c, e = counts[order].double(), exp[order]
    big = e >= 5
    obs = [c[big]] + ([c[~big].sum(0, keepdim=True)] if bool((~big).any()) else [])
    ex = [e[big]] + ([e[~big].sum(0, keepdim=True)] if bool((~big).any()) else [])
    o, x = torch.cat(obs).numpy(), torch.cat(ex).numpy()
    return float(chisquare(o, x * o.sum() / x.sum()).pvalue)


def joint3_counts(outs, vocab: int) -> torch.Tensor:
    """How often each 3-token continuation (x1, x2, x3) came out, flattened as ``exact_joint3`` lays the law out."""
    counts = torch.zeros(vocab**3, dtype=torch.long)
    for o in outs:
        a, b, c = o.token_ids
        counts[(a * vocab + b) * vocab + c] += 1
    return counts


def random_dspine(target, block_size: int, seed: int):
    """A DSpine draft for ``target`` with its injection and confidence weights random too (so it proposes
    varied, sometimes right, blocks)."""
    from dspine import init_draft

    d = init_draft(target, num_layers=2, block_size=block_size, seed=seed, intermediate_size=64, top_k=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "injection" in name or "confidence" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    d.confidence_trained = True
    return d


class Counting:
    """The scripted engine, counting how often it is opened and which rows it is asked for."""

    def __init__(self) -> None:
        self.opens, self.rows = 0, []

    def __call__(self, model, draft, args):
        self.opens += 1
        engine = scripted_engine(model, draft, args)
        run = engine.run

        def counted(requests, max_in_flight):
            def seen():
                for r in requests:
                    self.rows.append(r.row_id)
                    yield r
            return run(seen(), max_in_flight)

        engine.run = counted
        return engine


# a staged job (issue 41), shared by tests/stages and tests/objstore
QUESTIONS = {"type": "object", "properties": {"questions": {"type": "array", "items": {"type": "string"},
                                                            "minItems": 1, "maxItems": 3}},
             "required": ["questions"]}
JUDGE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5},
                                          "reason": {"type": "string"}}, "required": ["score", "reason"]}
Q_TEMPLATE = "Write questions about: {{ text }}"
A_TEMPLATE = "Text: {{ text }}\\nQuestion: {{ questions }}\\nAnswer briefly."
J_TEMPLATE = "Q: {{ questions }} A: {{ output }} Rate it."


def stage_docs(tmp_path, n=12):
    """Documents for a staged job (``staged_job``): ``doc_id`` and ``text``."""
    rows = [{"doc_id": f"d{i:02d}", "text": f"Document {i} says the tides follow the moon, part {i % 4}."}
            for i in range(n)]
    return write_jsonl(tmp_path / "docs.jsonl", rows)


def staged_job(tmp_path, src, out, extra: str = "", where: str = "len(reason) > 3", judge: str = "") -> str:
    """A three-stage job file (questions -> explode answers -> judge with where and dedup) reading ``src``; ``judge``:
    more keys of the judge stage (e.g. its own ``max-new-tokens``)."""
    job = tmp_path / "job.toml"
    job.write_text(f'''inputs = ["{src}"]
output = "{out}"
id-column = "doc_id"
max-new-tokens = 48
commit-rows = 3
{extra}
[[stages]]
name = "questions"
template = "{Q_TEMPLATE}"
json-schema = '{json.dumps(QUESTIONS)}'

[[stages]]
name = "answers"
explode = "questions"
template = "{A_TEMPLATE}"

[[stages]]
name = "judge"
template = "{J_TEMPLATE}"
json-schema = '{json.dumps(JUDGE)}'
where = "{where}"
dedup = "exact"
dedup-on = "score"
{judge}
''')
    return str(job)


_BASE = ["the tides of the open sea follow the moon and the sun, rising twice a day along every coast we know",
         "a binary search halves the interval at each step until the key is found or the interval is empty",
         "bread rises because yeast turns sugar into carbon dioxide, which the gluten network holds as bubbles",
         "rivers carry sediment downstream and drop it where the water slows, building deltas at their mouths"]


def near_docs(tmp_path):
    """Four groups of texts: each an original, its case/punctuation variant and a one-word edit (Jaccard of word
    3-grams ~0.85), plus texts that share words with them but are no near duplicates."""
    rows = []
    for g, text in enumerate(_BASE):
        words = text.split()
        edited = " ".join([*words[:-1], "today"])
        rows += [{"doc_id": f"g{g}-a", "text": text}, {"doc_id": f"g{g}-b", "text": text.upper() + "!"},
                 {"doc_id": f"g{g}-c", "text": edited}]
        rows.append({"doc_id": f"u{g}", "text": " ".join(reversed(words))})  # same words, other n-grams
    return write_jsonl(tmp_path / "near.jsonl", rows)


def near_job(tmp_path, src, out, extra: str = "", dedup: str = "minhash", commit_rows: int = 2) -> str:
    """A one-stage job file whose stage drops near duplicates of the input's ``text`` (``dedup = "minhash"``, 0.7;
    or ``dedup = "exact"``) writing to ``out`` (a directory or a URL)."""
    job = tmp_path / f"near-{str(out).rstrip('/').rsplit('/', 1)[-1]}.toml"
    job.write_text(f'''inputs = ["{src}"]
output = "{out}"
id-column = "doc_id"
max-new-tokens = 8
commit-rows = {commit_rows}
{extra}
[[stages]]
name = "notes"
template = "Note on: {{{{ text }}}}"
dedup = "{dedup}"
dedup-on = "text"
{"dedup-threshold = 0.7" if dedup == "minhash" else ""}
''')
    return str(job)
