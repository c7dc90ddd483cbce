"""Training a DSpine draft against a frozen target: capture, anchors, block-causal forward, losses.

The method is in ``docs/design.md``, "The DSpine draft". One readable file; the model-side pieces live in
``draft/model.py`` (``train_forward``, ``refine_slots``, ``block_causal_mask``). Works for any supported target on
CPU or CUDA. Per sequence:

1. **Capture** (``capture``): one frozen target forward gives the tap outputs (``draft.target_layer_ids``)
   and the final-norm hidden state; the teacher for slot k of the block at anchor a is
   ``softmax(lm_head(hidden[a+k-1]))``, i.e. the target's own next-token distribution. Captures are cached
   per example (in the draft dtype) because the target is frozen: later epochs cost only the draft.
2. **Anchors** (``sample_anchors``): uniform over positions whose token and successor are supervised,
   capped per sequence (CPU needs few; SpecForge uses up to 512), sorted.
3. **Blocks** ``[x_a, MASK x (bs-1)]`` at positions a..a+bs-1, all blocks of a sequence in one forward
   with the block-causal mask; labels ``x_{a+k}``, cut at the first unsupervised slot, weights
   ``w_k = exp(-(k-1)/gamma)``.
4. **Losses** (``block_losses``), all normalised by the sum of weights over the batch:
   backbone ``0.1 CE + 0.9 L1(p_draft, p_teacher)``; refinement over the top-k of the detached backbone
   logits refined with the *true* previous token (``0.1 CE`` when the label is a candidate, ``0.9 L1`` vs
   the teacher renormalised on the candidates, masked when its mass there is <= 1e-4); alignment
   ``sum_l (1 - cos(f_l, code(y)))`` scaled by ``beta(step) * mean CE`` (detached) with beta ramping
   0 -> 0.5; and teacher-forced predecessor replacement with probability ``p(step)``.

Examples marked ``teacher_forced`` (text the target did not write) take their labels from the target's argmax
instead of their own tokens, cut at the first in-block disagreement (``teacher.py``). Every checkpoint holds
what a stopped run needs to continue exactly (``train_state.py``; ``train(resume=True)``).

The confidence head is a separate frozen-backbone stage (``confidence.py``). ``TrainConfig.autocast =
"bfloat16"`` runs the draft's forward and backward under bf16 autocast with fp32 master weights (on CPUs
with AMX, bf16 GEMMs run ~4x faster than fp32 ones; the teacher distribution stays fp32). Not implemented:
gradient accumulation with an RNG-replayed pre-pass (one optimiser step = one batch here, so the mean CE
comes from the same pass).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dspine.draft.io import init_draft, load_draft
from dspine.draft.model import BlockOutput, DSpineDraft
from dspine.models.target import Target
from dspine.training.teacher import greedy_next, teacher_forced_targets
from dspine.training.train_state import (
    STATE_FILE,
    ResumeError,
    TrainerState,
    check_resumable,
    data_fingerprint,
    read_state,
    write_state,
)

# ----------------------------------------------------------------------------------------------------------
# data


@dataclass
class Example:
    """One tokenised training sequence: prompt + response ids, and which tokens are supervised."""

    ids: torch.Tensor  # [T] LongTensor
    loss_mask: torch.Tensor  # [T] bool: True on response (assistant) tokens
    dataset: str = ""
    teacher_forced: bool = False  # the response is not the target's own: labels come from its argmax (teacher.py)


def make_example(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    dataset: str = "",
    max_len: int = 0,
    teacher_forced: bool = False,
) -> Example:
    ids = list(prompt_ids) + list(response_ids)
    mask = [False] * len(prompt_ids) + [True] * len(response_ids)
    if max_len:
        ids, mask = ids[:max_len], mask[:max_len]
    return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), dataset, teacher_forced)


def load_examples(
    path: str | Path,
    tokenizer=None,
    max_len: int = 1024,
    split: str | None = None,
    teacher_forced: bool = False,
) -> list[Example]:
    """Read JSONL training data: ``prompt_ids``/``response_ids`` lists, or ``prompt``/``response`` text.

    Text needs ``tokenizer`` (an ``HFTokenizer``-like object with ``render_chat`` and ``tok``): the prompt is
    rendered with the chat template (generation prompt on) and the response encoded without special tokens,
    followed by the EOS id. ``split`` keeps only lines whose ``split`` field matches. A line with
    ``"teacher_forced": true`` (or every line, with ``teacher_forced``) holds text the target did not generate:
    it is trained on the target's own argmax labels (``teacher.py``) instead of its tokens.
    """
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if split is not None and rec.get("split", split) != split:
            continue
        if "prompt_ids" in rec:
            p, r = rec["prompt_ids"], rec["response_ids"]
        elif "prompt" in rec:
            if tokenizer is None:
                raise ValueError(f"{path}:{n}: text records need a tokenizer")
            p = tokenizer.render_chat([{"role": "user", "content": rec["prompt"]}])
            r = tokenizer.tok.encode(rec["response"], add_special_tokens=False).ids + tokenizer.eos_ids()[:1]
        else:
            raise ValueError(f"{path}:{n}: need prompt_ids/response_ids or prompt/response")
        tf = rec.get("teacher_forced", teacher_forced)
        if not isinstance(tf, bool):
            raise ValueError(f"{path}:{n}: teacher_forced must be true or false, not {tf!r}")
        if len(r) >= 2:
            out.append(make_example(p, r, rec.get("dataset", ""), max_len, tf))
    return out


def choose_draft_vocab(examples: Sequence[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` target ids a draft proposes from: the most frequent supervised (response) tokens of
    ``examples``, filled up with the lowest ids not yet chosen (BPE ids roughly follow merge order, so low ids
    are the tokenizer's most common pieces). Sorted ascending, as ``DSpineDraft.draft_vocab`` stores them.

    A token outside the set can never be proposed (that slot is then a sure rejection), so ``size`` trades
    coverage against the cost of the proposal head; ``bench_acceptance.py`` reports what it gives.
    """
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(ex.ids[ex.loss_mask], minlength=vocab_size)[:vocab_size]
    # frequency first; ties (including every unseen id) broken by the lower id (a stable sort keeps id order)
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


@dataclass
class Capture:
    taps: torch.Tensor  # [T, n*H] target tap outputs (row j = position j)
    hidden: torch.Tensor  # [T, H] final-norm hidden (teacher logits = lm_head(hidden))
    greedy: torch.Tensor | None = None  # [T] the target's argmax after each position (teacher-forced examples)


@torch.no_grad()
def capture(
    target: Target,
    ids: torch.Tensor,
    tap_ids: Sequence[int],
    dtype: torch.dtype | None = None,
    greedy: bool = False,
) -> Capture:
    """One frozen target forward over a full sequence: tap outputs and final-norm hidden states (and, with
    ``greedy``, the target's argmax labels from the full-precision hidden states, for teacher-forced text)."""
    ids = ids.to(target.device)[None]
    out = target.forward(ids, target.new_cache(1, ids.shape[1]), taps=tuple(tap_ids))
    dtype = dtype or target.dtype
    labels = greedy_next(target, out.hidden[0]) if greedy else None
    return Capture(out.taps[0].to(dtype), out.hidden[0].to(dtype), labels)


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted anchors: uniform without replacement over a with loss_mask[a] and loss_mask[a+1] (a >= 1)."""
    m = loss_mask.bool()
    ok = torch.zeros_like(m)
    ok[1:-1] = m[1:-1] & m[2:]
    cand = ok.nonzero().flatten()
    if len(cand) > max_anchors:
        cand = cand[torch.randperm(len(cand), generator=generator)[:max_anchors]]
    return cand.sort().values


# ----------------------------------------------------------------------------------------------------------
# schedules


def replacement_probability(step: int, total: int, p: float = 0.5, hold: float = 1 / 6, end: float = 1 / 3) -> float:
    """p(step): ``p`` until ``hold`` of training, linear to 0 at ``end``, 0 after."""
    frac = step / max(1, total)
    if frac <= hold:
        return p
    if frac >= end:
        return 0.0
    return p * (end - frac) / (end - hold)


def alignment_beta(step: int, warmup: int, weight: float = 0.5) -> float:
    """beta(step): linear 0 -> ``weight`` over ``warmup`` steps, then flat."""
    return weight if warmup <= 0 else weight * min(1.0, step / warmup)


def schedule_step(step: int, total: int, elapsed_s: float, time_budget_s: float | None) -> int:
    """The step the schedules (lr, replacement) use: ``step``, or further along when time runs out first.

    A time-boxed CPU run rarely knows its step rate in advance (captures make the first epoch slower); pacing
    the schedules by ``max(step / total, elapsed / budget)`` makes the cosine reach 0 when the run stops,
    whichever limit ends it, instead of stopping at a high learning rate.
    """
    if time_budget_s is None or time_budget_s <= 0:
        return step
    return max(step, min(total, int(total * elapsed_s / time_budget_s)))


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# ----------------------------------------------------------------------------------------------------------
# losses


@dataclass
class LossSums:
    """Weighted sums over a batch (divide by ``weight``); tensors carry gradients, floats are for logging."""

    backbone: torch.Tensor
    refine: torch.Tensor
    align: torch.Tensor
    ce: torch.Tensor  # sum w * CE (detached: the alignment scale, and a log)
    weight: torch.Tensor
    correct: torch.Tensor  # sum w * [argmax == label] (backbone, log only)
    refine_correct: torch.Tensor  # sum w * [refined argmax == label] (log only)


def block_targets(ex: Example, anchors: torch.Tensor, bs: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [N, bs-1] (x_{a+k}) and weights [N, bs-1]: w_k = exp(-(k-1)/gamma), cut at the first unsupervised slot."""
    T = ex.ids.shape[0]
    k = torch.arange(1, bs)
    idx = anchors[:, None] + k[None, :]  # [N, bs-1]
    inside = idx < T
    idx = idx.clamp(max=T - 1)
    labels = ex.ids[idx]
    ok = (inside & ex.loss_mask[idx]).long().cumprod(dim=1).bool()
    w = torch.exp(-(k - 1).float() / gamma)[None, :] * ok
    return labels, w


def block_losses(
    draft: DSpineDraft,
    target: Target,
    out: BlockOutput,
    teacher_hidden: torch.Tensor,
    true_tokens: torch.Tensor,
    labels: torch.Tensor,
    w: torch.Tensor,
    ce_weight: float = 0.1,
    mass_threshold: float = 1e-4,
) -> LossSums:
    """The DSpine losses of one sequence's blocks, as weighted sums.

    teacher_hidden [N, bs-1, H] = target final-norm hidden at a+k-1; true_tokens [N, bs] = x_a..x_{a+bs-1}.
    """
    head = target.head_weight.detach()
    N, n, H = teacher_hidden.shape
    # Both distributions live on the draft vocabulary (the whole vocabulary without one): the teacher is the
    # target's distribution renormalised there, and CE is counted only where the label is in it.
    logits = draft.head_logits(out.hidden[:, 1:], target)  # [N, bs-1, V'] fp32
    with torch.no_grad(), torch.autocast(teacher_hidden.device.type, enabled=False):
        teacher = torch.softmax(draft.head_logits(teacher_hidden.float(), target), dim=-1)  # [N, bs-1, V'] fp32
    logp = torch.log_softmax(logits, dim=-1)
    label_idx, present = draft.vocab_index(labels)
    ce = -logp.gather(-1, label_idx[..., None])[..., 0] * present  # [N, bs-1]
    l1 = (logp.exp() - teacher).abs().sum(-1)
    backbone = (w * ((ce_weight * ce) + (1 - ce_weight) * l1)).sum()

    # refinement: candidates from the detached backbone logits, predecessor = the true previous token
    k = min(draft.top_k, logits.shape[-1])
    cand_idx = logits.detach().topk(k, dim=-1).indices  # [N, bs-1, k] into the draft vocabulary
    cand = draft.vocab_ids(cand_idx)  # target ids
    refined = draft.refine_slots(out, true_tokens[:, :-1])  # [N, bs-1, H]
    scores = torch.einsum("nsh,nskh->nsk", refined.to(head.dtype), head[cand]).float()  # [N, bs-1, k]
    rlogp = torch.log_softmax(scores, dim=-1)
    hit = cand == labels[..., None]  # [N, bs-1, k]
    covered = hit.any(-1)
    rce = -(rlogp * hit).sum(-1)  # CE over candidates where the label is one of them
    t_c = teacher.gather(-1, cand_idx)  # [N, bs-1, k]
    mass = t_c.sum(-1)
    rl1 = (rlogp.exp() - t_c / mass.clamp_min(1e-12)[..., None]).abs().sum(-1)
    refine = (w * (ce_weight * rce * covered + (1 - ce_weight) * rl1 * (mass > mass_threshold))).sum()

    # alignment: post-injection features of every layer toward the label's code
    codes = draft.transfer_codes[labels]  # [N, bs-1, r]
    align = sum((w * (1 - F.cosine_similarity(f[:, 1:].float(), codes.float(), dim=-1))).sum() for f in out.post_feats)

    with torch.no_grad():
        correct = (w * (draft.vocab_ids(logits.argmax(-1)) == labels)).sum()
        rcorrect = (w * (cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0] == labels)).sum()
    return LossSums(backbone, refine, align, (w * ce).sum().detach(), w.sum(), correct, rcorrect)


# ----------------------------------------------------------------------------------------------------------
# the loop


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 6e-4
    weight_decay: float = 0.0
    batch_size: int = 4  # sequences per optimiser step
    anchors_per_seq: int = 32
    gamma: float = 7.0
    ce_weight: float = 0.1
    alignment_weight: float = 0.5
    alignment_warmup_steps: int = 146
    replacement_probability: float = 0.5
    replacement_hold_ratio: float = 1 / 6
    replacement_end_ratio: float = 1 / 3
    replacement_layers: int = 3
    candidate_mass_threshold: float = 1e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None  # stop (and save) after this many seconds of training
    save_every: int = 100
    log_every: int = 10
    capture_dtype: str | None = None  # keep captures in this dtype ("bfloat16" halves their memory); None: the draft's
    autocast: str | None = None  # "bfloat16": draft forward/backward under autocast (fp32 weights and optimiser)
    block_size: int | None = None  # train blocks of this many slots (<= the draft's); None: the draft's own block


def trainable_parameters(draft: DSpineDraft) -> list[torch.nn.Parameter]:
    """Everything the draft owns; the target (embeddings, lm_head) is never part of it, codes are buffers."""
    return [p for p in draft.parameters() if p.requires_grad]


def _autocast(cfg: TrainConfig, device: torch.device):
    """bf16 autocast on ``device`` when ``cfg.autocast`` asks for it, else a no-op context."""
    if not cfg.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, cfg.autocast))


def train_block_size(draft: DSpineDraft, cfg: TrainConfig) -> int:
    """The block a training step uses: ``cfg.block_size`` when set, else the draft's own.

    In-block attention is causal, so the first k slots of a block never see the later ones: a block-8 draft
    trained on blocks of 3 is the same model on its first two proposals, with all of the step's compute spent
    on the slots a block-3 decode verifies (``decode.json``), and it still loads and decodes at any block <= 8.
    """
    bs = cfg.block_size or draft.block_size
    if not 2 <= bs <= draft.block_size:
        raise ValueError(f"training block_size {bs} out of range 2..{draft.block_size} (the draft's block)")
    return bs


def train_step(
    draft: DSpineDraft,
    target: Target,
    batch: list[tuple[Example, Capture]],
    step: int,
    cfg: TrainConfig,
    gen: torch.Generator,
) -> dict:
    """Forward + backward of one batch (no optimiser step); returns floats for logging.

    Freezes the target first (idempotent): its embeddings and lm_head are used by the draft's forward, and a
    gradient must never reach them.
    """
    target.requires_grad_(False)
    bs = train_block_size(draft, cfg)
    p_rep = replacement_probability(
        step, cfg.steps, cfg.replacement_probability, cfg.replacement_hold_ratio, cfg.replacement_end_ratio
    )
    sums: list[LossSums] = []
    dev = draft.device
    for ex, cap in batch:
        anchors = sample_anchors(ex.loss_mask, cfg.anchors_per_seq, gen)
        if len(anchors) == 0:
            continue
        if ex.teacher_forced:
            if cap.greedy is None:
                raise ValueError("a teacher-forced example needs a capture with greedy labels (capture(greedy=True))")
            greedy = cap.greedy.to(ex.ids.device)
            labels, w = teacher_forced_targets(ex.ids, ex.loss_mask, greedy, anchors, bs, cfg.gamma)
        else:
            labels, w = block_targets(ex, anchors, bs, cfg.gamma)
        idx = (anchors[:, None] + torch.arange(bs)[None, :]).clamp(max=len(ex.ids) - 1)
        true_tokens = ex.ids[idx]  # [N, bs]
        block = torch.full_like(true_tokens, draft.mask_token_id)
        block[:, 0] = true_tokens[:, 0]
        replace = torch.rand(len(anchors), generator=gen) < p_rep
        anchors, labels, w, true_tokens, block, replace = (
            t.to(dev) for t in (anchors, labels, w, true_tokens, block, replace)
        )
        th = cap.hidden[(anchors[:, None] + torch.arange(bs - 1, device=dev)[None, :]).clamp(max=len(ex.ids) - 1)]
        with _autocast(cfg, dev):  # forward and losses only; backward runs outside, in the recorded dtypes
            out = draft.train_forward(
                cap.taps, anchors, block, target, replace=replace, true_tokens=true_tokens,
                replace_layers=min(cfg.replacement_layers, len(draft.layers)) if p_rep > 0 else 0,
            )  # fmt: skip
            sums.append(block_losses(draft, target, out, th, true_tokens, labels, w, cfg.ce_weight,
                                     cfg.candidate_mass_threshold))  # fmt: skip
    if not sums:
        return {}
    W = sum(s.weight for s in sums).clamp_min(1e-8)
    mean_ce = sum(s.ce for s in sums) / W
    beta = alignment_beta(step, cfg.alignment_warmup_steps, cfg.alignment_weight)
    backbone = sum(s.backbone for s in sums) / W
    refine = sum(s.refine for s in sums) / W
    align = sum(s.align for s in sums) / W
    loss = backbone + refine + beta * mean_ce * align
    loss.backward()
    return {
        "loss": float(loss.detach()),
        "backbone": float(backbone.detach()),
        "refine": float(refine.detach()),
        "align": float(align.detach()),
        "ce": float(mean_ce),
        "acc": float(sum(s.correct for s in sums) / W),
        "refine_acc": float(sum(s.refine_correct for s in sums) / W),
        "beta": beta,
        "p_replace": p_rep,
    }


def save_checkpoint(draft: DSpineDraft, out_dir: str | Path, meta: dict, state: TrainerState | None = None) -> None:
    """Save atomically (write a sibling dir, then swap), so a stopped run always leaves a loadable draft, and
    the trainer state (``train_state.py``) travels in the same swap, so weights and state never disagree."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():  # left by a run killed mid-write
        shutil.rmtree(tmp)
    draft.save(tmp)
    (tmp / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    if state is not None:
        write_state(tmp, state)
        with open(tmp / "history.jsonl", "w") as fh:
            fh.writelines(json.dumps(h) + "\n" for h in state.history)
    old = out_dir.with_name(out_dir.name + ".old")
    if old.exists() and out_dir.exists():
        shutil.rmtree(old)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old.exists():
        shutil.rmtree(old)


def checkpoint_dir(out_dir: str | Path) -> Path:
    """``out_dir``, or its ``.old`` sibling when a run was killed between the two renames of a save."""
    out_dir = Path(out_dir)
    old = out_dir.with_name(out_dir.name + ".old")
    if not out_dir.exists() and old.is_dir():
        old.rename(out_dir)
    return out_dir


class _StopRequest:
    """SIGINT/SIGTERM while training: finish the step, save, return (a second signal acts as usual)."""

    def __init__(self, log: Callable[[str], None]):
        self.requested = False
        self.log = log
        self.previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.log(f"signal {signum}: stopping after this step (the checkpoint is resumable)")
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _remaining(step: int, total: int, elapsed: float, budget: float | None) -> str:
    """What is left, for the progress bar: steps, and seconds when a time budget may end the run first."""
    left = f"{total - step} steps"
    if budget:
        left += f" / {max(0.0, budget - elapsed):.0f}s"
    return left


def train(
    target: Target,
    examples: list[Example],
    out_dir: str | Path | None,
    cfg: TrainConfig,
    draft: DSpineDraft | None = None,
    num_layers: int = 2,
    block_size: int = 16,
    draft_overrides: dict | None = None,
    log: Callable[[str], None] = print,
    resume: bool = False,
    progress: bool = True,
) -> DSpineDraft:
    """Train ``draft`` (or a fresh ``init_draft(target, ...)``) on ``examples``; save to ``out_dir`` as it goes.

    A fresh draft's final norm starts as a copy of the target's (both feed the same lm_head, so the
    per-channel output scale starts where the head expects it; a cheap prior, not a measured win).
    The target is frozen (``requires_grad_(False)``, no_grad capture); its embeddings and lm_head are used
    by the draft but are never optimiser parameters. Returns the trained draft (train mode off).

    With ``resume`` and a trainer state in ``out_dir`` (every checkpoint has one), the run continues from it:
    the checkpoint's draft replaces ``draft``, and the remaining steps replay exactly what an uninterrupted
    run would have done (``train_state.py``). SIGINT/SIGTERM stop after the current step with a checkpoint.
    ``progress`` shows a tqdm bar (steps, loss, what remains) on stderr.
    """
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    target.requires_grad_(False).eval()
    fingerprint = data_fingerprint(examples)
    state = read_state(checkpoint_dir(out_dir)) if resume and out_dir is not None else None
    if resume and state is None and out_dir is not None and (Path(out_dir) / "config.json").is_file():
        raise ResumeError(
            f"{out_dir}: a draft without {STATE_FILE} (saved before checkpoints were resumable, or not by training); "
            "warm-start from it into a new output directory instead"
        )
    if state is not None:
        check_resumable(state, asdict(cfg), fingerprint, Path(out_dir) / STATE_FILE)
        draft = load_draft(out_dir, device=target.device)
        log(f"resuming {out_dir} at step {state.step} (epoch {state.epoch}, {state.elapsed_s:.0f}s trained)")
    elif draft is None:
        draft = init_draft(target, num_layers=num_layers, block_size=block_size, seed=cfg.seed,
                           **(draft_overrides or {}))  # fmt: skip
        norm = getattr(target, "norm", None)
        if norm is not None and norm.weight.shape == draft.norm.weight.shape and norm.offset == draft.norm.offset:
            with torch.no_grad():
                draft.norm.weight.copy_(norm.weight)
    draft.train()
    params = trainable_parameters(draft)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    warmup = max(1, round(cfg.warmup_ratio * cfg.steps))
    captures: dict[int, Capture] = {}
    capture_dtype = getattr(torch, cfg.capture_dtype) if cfg.capture_dtype else draft.dtype
    order: list[int] = []
    epoch, start, prior_s = 0, 0, 0.0
    history: list[dict] = []
    if state is not None:
        opt.load_state_dict(state.optimizer)
        rng.setstate(state.py_rng)
        gen.set_state(state.gen)
        torch.set_rng_state(state.torch_rng)
        if state.cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state.cuda_rng)
        order, epoch, start, prior_s = list(state.order), state.epoch, state.step, state.elapsed_s
        history = list(state.history)
    t0 = time.perf_counter()

    def elapsed() -> float:
        return prior_s + time.perf_counter() - t0

    def snapshot(next_step: int) -> TrainerState:
        return TrainerState(
            step=next_step, elapsed_s=elapsed(), optimizer=opt.state_dict(), py_rng=rng.getstate(),
            gen=gen.get_state(), torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            order=list(order), epoch=epoch, config=asdict(cfg), data_fingerprint=fingerprint, history=list(history),
        )  # fmt: skip

    meta = {"config": asdict(cfg), "examples": len(examples), "tokens": int(sum(len(e.ids) for e in examples)),
            "teacher_forced_examples": sum(e.teacher_forced for e in examples)}  # fmt: skip
    step = start
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    with _StopRequest(log) as stop, bar:
        for step in range(start, cfg.steps):
            if cfg.time_budget_s is not None and elapsed() > cfg.time_budget_s:
                log(f"time budget {cfg.time_budget_s:.0f}s reached at step {step}")
                break
            if stop.requested:
                log(f"stopped at step {step}")
                break
            batch = []
            for _ in range(cfg.batch_size):
                if not order:
                    order = list(range(len(examples)))
                    rng.shuffle(order)
                    epoch += 1
                i = order.pop()
                if i not in captures:
                    captures[i] = capture(target, examples[i].ids, draft.target_layer_ids, capture_dtype,
                                          greedy=examples[i].teacher_forced)  # fmt: skip
                batch.append((examples[i], captures[i]))
            opt.zero_grad(set_to_none=True)
            sstep = schedule_step(step, cfg.steps, elapsed(), cfg.time_budget_s)
            lr = cfg.lr * lr_factor(sstep, cfg.steps, warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            stats = train_step(draft, target, batch, sstep, cfg, gen)
            bar.update(1)
            if stats:
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                stats.update(step=step, lr=lr, grad_norm=float(gnorm), elapsed=elapsed(), epoch=epoch)
                history.append(stats)
                bar.set_postfix(loss=f"{stats['loss']:.4g}", epoch=epoch,
                                left=_remaining(step + 1, cfg.steps, elapsed(), cfg.time_budget_s))  # fmt: skip
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
            if out_dir is not None and cfg.save_every and (step + 1) % cfg.save_every == 0:
                meta.update(steps_done=step + 1, elapsed_s=elapsed())
                save_checkpoint(draft, out_dir, meta, snapshot(step + 1))
        else:
            step = cfg.steps
    draft.eval()
    meta.update(steps_done=step, elapsed_s=elapsed(), last=history[-1] if history else None)
    if out_dir is not None:
        save_checkpoint(draft, out_dir, meta, snapshot(step))
    return draft
