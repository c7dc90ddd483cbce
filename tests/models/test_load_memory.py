"""One copy of each weight (issue 44): the checkpoint is memory-mapped, a packed-cache hit never reads (nor keeps)
the float linears, a stale cache entry is repacked, and the draft's cached packed form changes no token."""

from __future__ import annotations

import pytest
import torch
from helpers import save_random_draft, save_tiny_hf, to_gguf_grids, token_prompts
from safetensors.torch import load_file
from torch import nn

from dspine import generate, load_draft, load_target
from dspine.cpu import kernels
from dspine.models import llama, registry
from dspine.models.checkpoint import mapped_tensors
from dspine.models.layers import fuse_linears

pytestmark = pytest.mark.skipif(kernels.disabled() or kernels.load() is None, reason="no CPU kernels here")


@pytest.fixture()
def pack_cache(tmp_path, monkeypatch):
    """The packed-weights cache in a fresh folder, for checkpoints of any size (tiny ones are not cached)."""
    where = tmp_path / "packed"
    where.mkdir()
    monkeypatch.setattr(registry, "PACK_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "pack_cache_path", lambda key: where / f"{key}.safetensors")
    return where


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """A tiny Llama whose linears sit on GGUF grids (packed as Q4_1/Q8_0 blocks) and with an untied head."""
    return save_tiny_hf(tmp_path_factory.mktemp("gguf"), "llama", gguf=True, tie_word_embeddings=False,
                        hidden_size=128, intermediate_size=256)


def _logits(target, seed=0):
    ids = torch.randint(1, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    return target.logits(target.forward(ids, target.new_cache(2, 16)).hidden)


def _linear_shapes(path) -> set[tuple[int, ...]]:
    return {tuple(t.shape) for n, t in load_file(f"{path}/model.safetensors").items()
            if t.ndim == 2 and "embed" not in n and "lm_head" not in n}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_hit_holds_no_float_master_copy(gguf_dir, pack_cache, monkeypatch, dtype):
    """The second load reads the packed linears from the cache: nothing is packed from floats, outputs are the
    first load's bit for bit, and the target holds no fp32 tensor of a linear's shape; its tensors other than the
    packed ones and the embeddings/head weigh a few per cent of the float linears (norms, RoPE tables)."""
    if dtype == torch.bfloat16 and not kernels.bf16dp_ok():
        pytest.skip("no AVX512-BF16 here")
    first = load_target(gguf_dir, dtype=dtype)
    assert list(pack_cache.iterdir()), "the first load wrote the cache"
    want = _logits(first)

    def no_packing(*a, **k):
        raise AssertionError("a cache hit packed a float weight")

    fused = []

    def shapes_only(*linears):  # a cache hit fuses shapes: no float linear weight is read (or even in memory)
        fused.append([lin.weight.is_meta for lin in linears])
        return fuse_linears(*linears)

    monkeypatch.setattr(kernels.PackedLinear, "__init__", no_packing)
    monkeypatch.setattr(llama, "fuse_linears", shapes_only)
    target = load_target(gguf_dir, dtype=dtype)
    assert fused and all(all(meta) for meta in fused), fused
    assert torch.equal(_logits(target), want)
    assert not [n for n, m in target.layers.named_modules() if isinstance(m, nn.Linear)]
    shapes = _linear_shapes(gguf_dir)
    tensors = dict(target.named_parameters()) | dict(target.named_buffers())
    float_embed = ("embed_tokens.", "lm_head.")  # mapped, read by ``embed`` and by the draft's head rows
    assert not [n for n, t in tensors.items()
                if t.dtype == torch.float32 and tuple(t.shape) in shapes and not n.startswith(float_embed)]
    packed = sum(m.packed.nbytes for m in target.layers.modules() if isinstance(m, kernels.PackedLinear))
    float_linears = sum(4 * a * b for a, b in shapes)
    other = sum(t.nbytes for n, t in tensors.items()
                if not n.endswith(".packed") and not n.startswith(("embed_tokens.", "lm_head.")))
    assert packed < float_linears and other < 0.1 * float_linears, (packed, other, float_linears)


def test_the_checkpoint_is_mapped_not_copied(gguf_dir):
    """Without the kernels the target's tensors are views of the checkpoint file's map, equal to the file's."""
    target = load_target(gguf_dir, kernels=False)
    stored = load_file(f"{gguf_dir}/model.safetensors")
    mapped = mapped_tensors(f"{gguf_dir}/model.safetensors")
    assert set(mapped) == set(stored) and all(torch.equal(mapped[n], t) for n, t in stored.items())
    w = target.embed_tokens.weight
    assert torch.equal(w, stored["model.embed_tokens.weight"])
    assert w.untyped_storage().nbytes() > w.nbytes  # a view of the whole file, not a copy of one tensor


@pytest.mark.parametrize("damage", ["garbage", "other model"])
def test_a_stale_cache_entry_is_repacked(gguf_dir, pack_cache, tmp_path, damage):
    want = _logits(load_target(gguf_dir, kernels=True))  # writes the entry
    (entry,) = pack_cache.iterdir()
    if damage == "garbage":
        entry.unlink()  # replaced, as our writers do (a map of the old file stays valid)
        entry.write_bytes(b"not a safetensors file")
    else:  # a well-formed entry of another checkpoint (other shapes)
        other = save_tiny_hf(tmp_path / "other", "llama", hidden_size=64, intermediate_size=96)
        load_target(other)
        (donor,) = [p for p in pack_cache.iterdir() if p != entry]
        entry.unlink()
        entry.write_bytes(donor.read_bytes())
    assert torch.equal(_logits(load_target(gguf_dir)), want)
    assert torch.equal(_logits(load_target(gguf_dir)), want)  # the repack rewrote it: a hit now


def test_the_cached_draft_changes_no_token(tmp_path, pack_cache, llama_dir):
    """The draft packed from its cache proposes what the freshly packed one does: greedy speculative outputs are
    the same tokens, and plain decoding's."""
    target = save_random_draft(llama_dir, tmp_path / "draft", seed=3)
    key = registry.checkpoint_key(tmp_path / "draft")
    assert key is not None
    prompts = token_prompts(4, target.vocab_size, seed=9)
    plain = [o.token_ids for o in generate(target, None, prompts, max_new_tokens=24)]
    fresh = load_draft(tmp_path / "draft").use_kernels()
    cold = load_draft(tmp_path / "draft").use_kernels(key)  # packs and writes the entry
    assert (pack_cache / f"draft-{key}.safetensors").is_file()
    warm = load_draft(tmp_path / "draft").use_kernels(key)  # reads it
    assert not [m for m in warm.modules() if isinstance(m, nn.Linear)]
    for draft in (fresh, cold, warm):
        spec = [o.token_ids for o in generate(target, draft, prompts, max_new_tokens=24)]
        assert spec == plain
    outs = [[(o.token_ids, o.stats.verify_steps) for o in generate(target, d, prompts, max_new_tokens=24)]
            for d in (fresh, warm)]
    assert outs[0] == outs[1]  # the same proposals, so the same schedule


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_grid_search_in_chunks_and_probes_finds_what_one_search_does(monkeypatch, fmt):
    """``exact_q8_0`` / ``exact_q4_1`` searched a chunk of rows at a time (bounded temporaries) and refused early on
    their first blocks give the whole search's answer: the same blocks, and None for a weight one value off its grid
    (in the last chunk, past the probe) or on no grid at all (a bf16 weight)."""
    g = torch.Generator().manual_seed(7)
    n, k = 700, 256
    grid = nn.Module()
    grid.register_parameter("embed" if fmt == "q8_0" else "proj", nn.Parameter(torch.randn(n, k, generator=g)))
    with torch.no_grad():
        to_gguf_grids(grid)  # Q8_0 for embeddings, Q4_1 for the rest, as a GGUF converter leaves them
    w = next(grid.parameters()).detach()
    find = kernels.exact_q8_0 if fmt == "q8_0" else kernels.exact_q4_1
    whole = find(w)
    assert whole is not None
    monkeypatch.setattr(kernels, "_CHUNK_ELEMS", 64 * k)  # 11 chunks of 64 rows
    chunked = find(w)
    assert chunked is not None and all(torch.equal(a, b) for a, b in zip(whole, chunked))
    off = w.clone()
    off[-1, 5] += 1e-4  # past the probe blocks, in the last chunk
    assert find(off) is None
    assert find(torch.randn(n, k, generator=g).bfloat16().float()) is None
