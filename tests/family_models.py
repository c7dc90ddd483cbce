"""Tiny random models of the dense families beyond Llama/Qwen3, made with the installed ``transformers`` from each
family's own config class with its distinctive options on (the oracle for ``tests/models/test_families.py`` and the
GGUF tests). Small enough that a family's whole test runs in seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# family -> (config class, model class, the family's distinctive options)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # QKV biases, yarn scaling
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=False, max_position_embeddings=128,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 32})),
    # sliding window on every layer
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16, tie_word_embeddings=False)),
    # 1+w norms, embedding scaling, local/global layers with their own RoPE bases, QK-norm, final soft-capping,
    # linear scaling on the global layers
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1000000.0}})),
    # NoPE layers (every 4th: layer 3 here), llama3 scaling
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(tie_word_embeddings=True, no_rope_layer_interval=2,
                     rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                      "rope_theta": 10000.0})),
    # post-norms, QK-norm over the whole projection
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False)),
    # embedding / residual / attention multipliers, logits scaling
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                     logits_scaling=8.0, tie_word_embeddings=True)),
    # fused qkv / gate_up, partial rotary, longrope (long factors past 32 positions)
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(tie_word_embeddings=True, original_max_position_embeddings=32,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                   "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
}


def save_tiny_family(path: str | Path, family: str, seed: int = 0, head_scale: float = 6.0, **kw) -> str:
    """Save a tiny random ``family`` model (``FAMILIES``) to ``path``; ``kw`` overrides config values."""
    import transformers

    conf_name, model_name, options = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, conf_name)(**{**COMMON, **options, **kw})
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and family in ("gemma3",):
                p.normal_(0.0, 0.2)  # zero-initialised (1 + w) norms would test nothing
            elif "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
        model.lm_head.weight.mul_(head_scale)  # peaked distributions: greedy and sampled tests mean something
    model.save_pretrained(str(path))
    return str(path)


# Gemma 4's text decoder with its distinctive options on: sliding/full layers (full: their own head size and one KV
# head, keys = values, proportional RoPE over a quarter of the frequencies), per-layer inputs, the last two layers
# sharing the KV of the last earlier layer of their type with a double-wide MLP, final soft-capping
GEMMA4 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"],
              num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=256, final_logit_softcapping=30.0, max_position_embeddings=1024,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def save_tiny_gemma4(path: str | Path, seed: int = 0, head_scale: float = 4.0, **kw) -> str:
    """A tiny random ``Gemma4ForCausalLM`` (``GEMMA4`` with ``kw`` over it): norms around 1 (Gemma 4's are
    ``x * w``), each layer's ``layer_scalar`` random, weights at 4x the default scale so that every piece moves the
    logits."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Gemma4TextConfig(**{**GEMMA4, "initializer_range": 0.08, **kw})
    model = transformers.Gemma4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(str(path))
    return str(path)


def check_ragged_prefill_decode_verify(ours, ref, seed: int, label: str = "") -> None:
    """Rows of 5, 19 and 40 tokens prefilled together, two decode steps, a 3-token speculative verify of which 1-3
    tokens are kept, one more step: every logit of ``ours`` within 1e-4 of ``ref``'s (HF) forward over the row's whole
    sequence, on the logits' own scale (1e-4 times the row's largest |logit| when that is above 1). fp32 sums in
    another order differ by a few ulps of the largest values they pass through, and how many depends on the
    processor (our kernels' AVX-512 order on an AMX Xeon put Gemma 4's 40-token row at 1.4e-4 beside logits of 13,
    1.0e-5 of their scale); a wrong weight, mask or position is off by orders of magnitude more. Shared by every
    family's test and Gemma 4's."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 19, 40]
    ids = torch.zeros(3, 40, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(3, 256, (n,), generator=g)
    cache = ours.new_cache(3, 8)
    out = ours.logits(ours.forward(ids, cache, n_valid=torch.tensor(lens)).hidden)
    got = [[out[b, :n]] for b, n in enumerate(lens)]
    seqs = [ids[b, :n] for b, n in enumerate(lens)]
    for _ in range(2):
        step = torch.randint(3, 256, (3, 1), generator=g)
        out = ours.logits(ours.forward(step, cache).hidden)
        for b in range(3):
            got[b].append(out[b])
            seqs[b] = torch.cat([seqs[b], step[b]])
    block = torch.randint(3, 256, (3, 3), generator=g)
    out = ours.logits(ours.forward(block, cache, speculative=True).hidden)
    keep = [1, 3, 2]
    ours.commit(cache, torch.tensor(keep))
    for b in range(3):
        got[b].append(out[b, : keep[b]])
        seqs[b] = torch.cat([seqs[b], block[b, : keep[b]]])
    last = torch.randint(3, 256, (3, 1), generator=g)
    out = ours.logits(ours.forward(last, cache).hidden)
    for b in range(3):
        got[b].append(out[b])
        seqs[b] = torch.cat([seqs[b], last[b]])
        with torch.no_grad():
            expect = ref(seqs[b][None]).logits[0]
        scale = max(1.0, expect.abs().max().item())
        assert (torch.cat(got[b]) - expect).abs().max().item() < 1e-4 * scale, (label, b)


def check_speculation_equals_plain(target, prompts: list[list[int]]) -> None:
    """Suffix proposals (no draft; greedy and sampled rows, flat prices so they run) and an initialised DSpine
    draft give the plain tokens, with suffix steps and verifies really taken."""
    from dspine import generate, init_draft
    from dspine.decoding.cost import CostModel

    cheap = CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=0.05)
    params = dict(max_new_tokens=20, temperature=[0.0, 0.8, 0.0, 1.0], seed=[1, 2, 3, 4], top_k=40)
    plain = generate(target, None, prompts, **params)
    suffix = generate(target, None, prompts, verify="cost", cost=cheap, prices="static", proposers="suffix",
                      batch_size=2, **params)
    assert [s.token_ids for s in suffix] == [p.token_ids for p in plain]
    assert sum(s.stats.suffix_steps for s in suffix) > 0
    draft = init_draft(target, num_layers=1, block_size=4, seed=1, intermediate_size=64)
    greedy = generate(target, None, prompts, max_new_tokens=20)
    spec = generate(target, draft, prompts, max_new_tokens=20)
    assert [s.token_ids for s in spec] == [p.token_ids for p in greedy]
    assert sum(s.stats.verify_steps for s in spec) > 0


# -- sampled-law helpers (the method of tests/decoding/test_generate.py: exact joint by enumeration, χ² pooled) --


# -- tiny GGUFs written with the ``gguf`` package, in llama.cpp's layouts (tests/embedded/test_gguf_families.py) --

_GGUF_BLOCK = {  # HF name within model.layers.N. -> GGUF name within blk.N. (llama.cpp's names)
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Phi-3: fused as Hugging Face stores them (gate first in ffn_up)
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
}
_PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's LlamaModel and subclasses permute Q/K
_POST_NORMS = {  # HF -> GGUF, for the families whose post_attention_layernorm follows attention
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "olmo2": {"post_attention_layernorm.weight": "post_attention_norm.weight",
              "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}


SPM_PIECES = ["\u2581", "t", "h", "e", "m", "i", "s", "o", "n", "a", "d", "r", "he", "\u2581t", "\u2581the", "\u2581a",
              "is", "\u2581is", "on", "\u2581on", "an", "\u2581an", "\u2581and", "em", "them", "\u2581them", "me",
              "\u2581theme", "or", "\u2581or", "\u2581s", "\u2581d", "\u2581h", "\u2581i", "\u2581m", "\u2581o"]


def spm_vocab(arch: str = "llama") -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """A small SentencePiece vocabulary as llama.cpp stores one (``tokenizer.ggml.model`` "llama"): the special
    tokens (Llama's ``<unk> <s> </s>``; Gemma's ``<pad> <eos> <bos> <unk> <mask>``), the 256 byte-fallback tokens,
    then pieces best-first (score = minus their rank); and the special ids (``bos``, ``eos``, ``unk``, ``pad``)."""
    if arch.startswith("gemma"):
        specials, ids, types = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], dict(pad=0, eos=1, bos=2, unk=3), \
            [3, 3, 3, 2, 3]
    else:
        specials, ids, types = ["<unk>", "<s>", "</s>"], dict(unk=0, bos=1, eos=2), [2, 3, 3]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    types = types + [6] * 256 + [1] * len(SPM_PIECES)  # unknown 2, control 3, byte 6, normal 1
    return tokens, scores, types, ids


def write_tiny_gguf(hf_dir: str | Path, out: str | Path, arch: str, pre: str = "gpt2", customize=None,
                    vocab: str = "bpe") -> Path:
    """Write the tiny HF model in ``hf_dir`` (with a byte-level BPE ``tokenizer.json``) as a GGUF of ``arch`` the
    way llama.cpp's converter lays it out: Llama's Q/K rows permuted for adjacent-pair RoPE, Gemma's norms stored
    as ``1 + w``, Gemma's pre-MLP norm as ``ffn_norm`` and its post-norms (and OLMo 2's) as ``post_attention_norm``
    / ``post_ffw_norm``; Phi-3's fused tensors as they are, its partial rotary as ``rope.dimension_count`` and
    longrope as ``rope_factors_long`` / ``rope_factors_short`` tensors; Granite's multipliers as ``granite.*_scale``
    keys; F32 tensors; ``pre``: the ``tokenizer.ggml.pre`` name; ``customize(writer)``: more metadata; ``vocab``
    "spm": ``spm_vocab()`` (SentencePiece, no merges: the model's vocabulary must be its size) instead of the
    directory's byte-level BPE."""
    import json
    import math

    import gguf
    from safetensors.torch import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    if arch != "phi3":  # llama.cpp's Phi3 converter writes no head size
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    extra: dict[str, np.ndarray] = {}
    if arch == "phi3":
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // n_heads
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra = {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                     "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
        rope = {"rope_theta": rope.get("rope_theta", 10000.0)}
    if arch == "granite":
        for key, add in (("attention_multiplier", w.add_attention_scale),
                         ("embedding_multiplier", w.add_embedding_scale),
                         ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
            if cfg.get(key):
                add(cfg[key])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    if vocab == "spm":
        tokens, scores, types, ids = spm_vocab(arch)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(ids["bos"])
        w.add_eos_token_id(ids["eos"])
        w.add_unk_token_id(ids["unk"])
        if "pad" in ids:
            w.add_pad_token_id(ids["pad"])
    else:
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        bpe = tok["model"]["vocab"]
        tokens = [t for t, _ in sorted(bpe.items(), key=lambda kv: kv[1])]
        types = [1] * len(tokens)
        for added in tok.get("added_tokens", []):
            types[added["id"]] = 3 if added.get("special") else 4
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(cfg.get("bos_token_id") or 0)
        w.add_eos_token_id(cfg.get("eos_token_id") or 0)
    w.add_vocab_size(cfg["vocab_size"])

    def permute(t: np.ndarray, heads: int) -> np.ndarray:  # HF rotate-half rows -> llama.cpp's pairs
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    if customize is not None:
        customize(w)
    for name, a in extra.items():
        w.add_tensor(name, a)
    for name, t in state.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            g = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest in _POST_NORMS.get(arch, {}):
                local = _POST_NORMS[arch][rest]
            elif rest == "post_attention_layernorm.weight":
                local = "ffn_norm.weight"
            else:
                local = _GGUF_BLOCK[rest]
            g = f"blk.{layer}.{local}"
        if arch in _PERMUTED and g.endswith("attn_q.weight"):
            a = permute(a, n_heads)
        elif arch in _PERMUTED and g.endswith("attn_k.weight"):
            a = permute(a, n_kv)
        if arch == "gemma3" and g.endswith("norm.weight"):
            a = a + np.float32(1.0)
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
