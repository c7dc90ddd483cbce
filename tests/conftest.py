"""Shared fixtures: tiny random targets saved by transformers (the oracle) and loaded by dspine."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(skip_gpu)


def save_tiny_hf(
    path,
    family: str = "llama",
    vocab: int = 256,
    layers: int = 3,
    seed: int = 0,
    head_scale: float | None = None,
    **kw,
) -> str:
    """Save a tiny random HF model (LlamaForCausalLM / Qwen3ForCausalLM) to ``path``; returns the path."""
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
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llama_target(llama_dir):
    from dspine import load_target

    return load_target(llama_dir)


@pytest.fixture(scope="session")
def qwen3_target(qwen3_dir):
    from dspine import load_target

    return load_target(qwen3_dir)


@pytest.fixture(scope="session")
def hybrid_target(tmp_path_factory):
    """A tiny Qwen3.5-style hybrid (GDN, full, GDN, full) target."""
    from test_qwen3_5 import save_tiny_qwen35

    from dspine import load_target

    return load_target(save_tiny_qwen35(tmp_path_factory.mktemp("hybrid")))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: decode-sized ops on a shared 2-core box lose 10-20x to OpenMP spin-waits otherwise."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
