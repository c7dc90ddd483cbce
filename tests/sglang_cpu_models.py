"""Tiny checkpoints and an engine runner for the SGLang end-to-end tests on CPU (tests/test_sglang_e2e.py,
tests/test_sglang_cli.py).

* ``random_pair``: a random Qwen3 target and a random DSpine draft whose injection weights are non-zero, so the
  injection after every layer and the last-write refinement of the transition cache really change proposals
  (a fresh ``init_draft`` has zero writes: exactly the causal DFlash backbone).
* ``constant_pair``: a target whose greedy next token is the same token X whatever the context (every
  embedding row is one shared direction plus a little noise, the decoder layers are damped, so the final
  state always points the same way) and a draft built the same way, which therefore proposes X at every slot:
  most rounds accept every draft (tau close to the block width), with non-zero injection weights too.
* ``run_engine``: start ``sglang.Engine`` (CPU test path without a GPU, CUDA with graphs on a GPU), run a
  workload, shut it down killing only the processes it started (``Engine.shutdown`` would kill every child of
  the test process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

BLOCK = 4
CONSTANT_TOKEN = 42
COMMON_KWARGS = dict(tp_size=1, dtype="float32", max_total_tokens=4096, max_running_requests=8,
                     mem_fraction_static=0.5, skip_tokenizer_init=True, log_level="error")
# Without a GPU: SGLang's CPU test path (dspine.sglang.cpu). With one (scripts/gpu_check.sh --sglang), the same
# tests run on CUDA with CUDA graphs on; triton attention because it takes the fp32 tiny models.
GPU_ENGINE_KWARGS = dict(device="cuda", attention_backend="triton", disable_cuda_graph=False, cuda_graph_max_bs=8)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def engine_kwargs() -> dict:
    from dspine_batch.sglang_args import cpu_defaults

    return {**COMMON_KWARGS, **(GPU_ENGINE_KWARGS if on_gpu() else cpu_defaults(speculative=False))}


def _draft(target_dir: str, out: Path, seed: int, damp: float | None = None):
    from dspine import load_target
    from dspine.draft_io import init_draft

    target = load_target(target_dir)
    draft = init_draft(target, num_layers=2, block_size=BLOCK, transfer_rank=8, message_size=16, top_k=4,
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


def random_pair(root: Path) -> tuple[str, str]:
    from conftest import save_tiny_hf

    tdir = save_tiny_hf(root / "target", "qwen3", vocab=256, layers=3, max_position_embeddings=4096)
    _draft(tdir, root / "draft", seed=3)
    return tdir, str(root / "draft")


def constant_pair(root: Path) -> tuple[str, str]:
    from conftest import save_tiny_hf
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
    _draft(tdir, root / "draft", seed=5, damp=0.05)
    return tdir, str(root / "draft")


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def run_engine(model: str, workload: Callable[[Any], Any], draft: str | None = None, env: dict | None = None,
               **kwargs) -> Any:
    """Start an engine (DSPINE when ``draft`` is given), return ``workload(engine)``, shut the engine down."""
    import sglang

    from dspine.sglang import plugin
    from dspine_batch.sglang_engine import scoped_shutdown

    plugin.register()
    kw = {**engine_kwargs(), "model_path": model, **kwargs}
    if draft is not None:
        kw.update(speculative_algorithm="DSPINE", speculative_draft_model_path=draft,
                  speculative_num_draft_tokens=BLOCK, speculative_draft_attention_backend=kw["attention_backend"])
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    before = _child_pids()
    try:
        engine = sglang.Engine(**kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        return workload(engine)
    finally:
        scoped_shutdown(engine, _child_pids() - before)
