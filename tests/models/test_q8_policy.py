"""A target under quant=q8 / q16 (the integer families of linears over GGUF blocks, the bf16 policy's KV cache):
its kernel name and formats, a row's logits independent of its neighbours and of the prompt being read in pieces,
greedy speculative output equal to plain output, the prefix cache, and the refusals (issue 34)."""

from __future__ import annotations

import pytest
import torch
from helpers import ScriptedDraft, random_mistakes, save_tiny_hf, save_tiny_qwen35, token_prompts

from dspine import generate, load_target
from dspine.cpu import kernels
from dspine.cpu.precision import resolve
from dspine.decoding.prefix import PrefixCache

pytestmark = pytest.mark.skipif(kernels.disabled() or kernels.load() is None, reason="CPU kernels off or unbuildable")

LAYERS = 3


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """A tiny llama whose weights are GGUF blocks (Q4_1 linears, Q8_0 tied embeddings), head_dim 32."""
    return save_tiny_hf(tmp_path_factory.mktemp("gguf-llama"), "llama", layers=LAYERS, hidden_size=128,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, gguf=True)


@pytest.fixture(scope="module", params=list(kernels.INT_FORMATS))
def q8(request, gguf_dir):
    return load_target(gguf_dir, dtype=torch.bfloat16, quant=request.param)


def test_the_blocks_run_on_integer_dot_products(q8, gguf_dir):
    kv = "-kvbf16dp" if kernels.bf16_attention(32) else "-kvbf16"
    policy = q8.kernel.split("-")[2]
    assert q8.kernel == f"dspine-{kernels.load()}-{policy}{kv}" and q8.kv_dtype == torch.bfloat16
    q4_1, q8_0 = kernels.INT_FORMATS[policy]
    assert kernels.weight_formats(q8) == {q4_1: 4 * LAYERS, q8_0: 1}
    ids = torch.randint(0, q8.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    fp32 = load_target(gguf_dir).score(ids)
    torch.testing.assert_close(q8.score(ids), fp32, rtol=0.05, atol=0.1)


def test_a_rows_logits_do_not_depend_on_its_neighbours_or_on_chunks(q8):
    ids = torch.randint(0, q8.vocab_size, (3, 40), generator=torch.Generator().manual_seed(5))
    together = q8.score(ids)
    for b in range(3):
        assert torch.equal(q8.score(ids[b : b + 1])[0], together[b])
    with torch.no_grad():
        whole = q8.forward(ids[:1], q8.new_cache(1, 40)).hidden[0, -1]
        cache = q8.new_cache(1, 40)
        q8.forward(ids[:1, :17], cache)
        split = q8.forward(ids[:1, 17:], cache).hidden[0, -1]
    assert torch.equal(whole, split)


@pytest.mark.parametrize("batch,bs", [(1, 4), (3, 16)])
def test_greedy_speculative_equals_plain(q8, batch, bs):
    prompts = token_prompts(batch, q8.vocab_size, seed=batch * 10 + bs)
    plain = [o.token_ids for o in generate(q8, None, prompts, max_new_tokens=20)]
    assert plain == [generate(q8, None, [p], max_new_tokens=20)[0].token_ids for p in prompts]
    for rate in (0.0, 0.5):
        draft = ScriptedDraft(prompts, plain, block_size=bs, mistake=random_mistakes(bs, rate))
        assert [s.token_ids for s in generate(q8, draft, prompts, max_new_tokens=20)] == plain


def test_the_prefix_cache_changes_no_output(q8):
    shared = token_prompts(1, q8.vocab_size, seed=3, lo=24, hi=24)[0]
    prompts = [shared + p for p in token_prompts(4, q8.vocab_size, seed=4)]
    alone = [o.token_ids for o in generate(q8, None, prompts, max_new_tokens=12, batch_size=2)]
    cache = PrefixCache(64 << 20)
    got = generate(q8, None, prompts, max_new_tokens=12, batch_size=2, prefix_cache=cache)
    assert [o.token_ids for o in got] == alone
    assert cache.served > 0


def test_refusals_and_resolution(tmp_path):
    assert resolve("auto", "q8").describe() == {"dtype": "bfloat16", "quant": "q8"}
    with pytest.raises(ValueError, match="bfloat16"):
        resolve("float32", "q8")
    with pytest.raises(ValueError, match="q8"):
        resolve("bfloat16", "q9")
    with pytest.raises(ValueError, match="quant=q16"):
        load_target(save_tiny_qwen35(tmp_path / "hybrid"), dtype=torch.bfloat16, quant="q16")
    # a checkpoint on no GGUF grid: every weight falls back (the bf16 family where it runs, else fp32)
    plain = load_target(save_tiny_hf(tmp_path / "plain", "llama"), dtype=torch.bfloat16, quant="q8")
    assert not set(kernels.weight_formats(plain)) & set(kernels.INT_FORMATS["q8"])
