"""``--model FILE.gguf`` for the GGUF architectures our families map to (llama, qwen2, qwen3, gemma3): tiny HF models
written as GGUFs with the ``gguf`` package's writer in llama.cpp's layouts (``family_models.write_tiny_gguf``),
converted once into the cache, loaded by ``load_target`` and compared with the HF originals; the tokenizer rebuilt
per pre-tokenizer name, an unknown one (and an unknown architecture) refused in one line naming it."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import save_tiny_family, spm_vocab, write_tiny_gguf
from helpers import SMOL_TEMPLATE, save_tiny_hf, tokenizer_dir

from dspine import load_target
from dspine.embedded import gguf_convert
from dspine.embedded.gguf_convert import GGUFConversionError, gguf_model_path

pytest.importorskip("gguf")

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "olmo2", "granite", "smollm3"]


def _tiny_hf(path, arch: str) -> str:
    vocab = tokenizer_dir(path, SMOL_TEMPLATE)
    if arch in ("llama", "qwen3"):
        return save_tiny_hf(path, arch, vocab=vocab, layers=2)
    if arch == "qwen2":  # biases, yarn
        return save_tiny_family(path, "qwen2", vocab_size=vocab, num_hidden_layers=2)
    if arch in ("phi3", "olmo2"):  # fused qkv / gate_up, partial rotary, longrope; post-norms, QK-norm over q / k
        return save_tiny_family(path, arch, vocab_size=vocab, num_hidden_layers=2)
    if arch == "granite":  # the four multipliers; weights 5x the default scale so that attention (scaled by
        # 0.0625) moves the logits well past 1e-4 (a wrong Q/K permutation must show)
        return save_tiny_family(path, arch, vocab_size=vocab, num_hidden_layers=2, initializer_range=0.1)
    if arch == "smollm3":  # NoPE on the 4th layer, the one pattern llama.cpp knows (no llama3 scaling: llama.cpp
        # stores it as a rope_freqs tensor, which we refuse)
        return save_tiny_family(path, "smollm3", vocab_size=vocab, no_rope_layer_interval=4,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # gemma3 as llama.cpp knows it: layers 1-5 sliding, the 6th global, query scale head_dim ** -0.5, linear
    # scaling on the global layer, no soft-capping (llama.cpp's gemma3 has none)
    return save_tiny_family(path, "gemma3", vocab_size=vocab, num_hidden_layers=6, query_pre_attn_scalar=16,
                            final_logit_softcapping=None,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            hf = _tiny_hf(tmp_path_factory.mktemp(f"hf-{arch}"), arch)
            gguf_file = write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf", arch,
                                        pre={"qwen2": "qwen2", "qwen3": "qwen2"}.get(arch, "gpt2"))
            made[arch] = hf, gguf_file, gguf_model_path(gguf_file, tmp_path_factory.mktemp(f"cache-{arch}") / "m")
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_gguf_matches_the_hf_original(arch, converted):
    import transformers

    hf, _, out = converted(arch)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == json.loads(open(f"{hf}/config.json").read())["model_type"]
    ours = load_target(out)
    assert ours.family == {"llama": "llama"}.get(arch, arch)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    # phi3: 30 tokens on longrope's short factors, 40 past its original 32 positions on the long ones
    for length in (30, 40) if arch == "phi3" else (30,):
        ids = torch.randint(3, ours.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expect = ref(ids).logits
        assert (ours.score(ids) - expect).abs().max().item() < 1e-4, (arch, length)


@pytest.mark.parametrize("arch", ["phi3", "olmo2", "granite", "smollm3"])
def test_converted_gguf_greedy_generate_equals_the_hf_original(arch, converted):
    import transformers

    from dspine import generate

    hf, _, out = converted(arch)
    ours = load_target(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # run to max_new_tokens, as dspine does without stops
    ref.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, ours.vocab_size, (n,), generator=g).tolist() for n in (5, 17)]
    mine = generate(ours, None, prompts, max_new_tokens=12)
    for p, o in zip(prompts, mine):
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == theirs, arch


def test_converted_config_reads_back_each_family(converted):
    """What llama.cpp keeps in metadata or tensors comes back as the HF config had it."""
    read = {a: json.loads((converted(a)[2] / "config.json").read_text()) for a in ("phi3", "granite", "smollm3")}
    phi = read["phi3"]["rope_parameters"]
    assert phi["rope_type"] == "longrope" and phi["partial_rotary_factor"] == 0.75
    assert phi["long_factor"] == [2.0 + 0.5 * i for i in range(6)] and phi["original_max_position_embeddings"] == 32
    assert "attention_factor" not in phi  # the default, recomputed by HF
    gr = read["granite"]
    assert (gr["embedding_multiplier"], gr["residual_multiplier"], gr["attention_multiplier"],
            gr["logits_scaling"]) == (12.0, 0.22, 0.0625, 8.0)
    assert read["smollm3"]["no_rope_layers"] == [1, 1, 1, 0]


def test_olmo3_sliding_window_refused_in_one_line(converted, tmp_path):
    hf, _, _ = converted("olmo2")
    # llama.cpp writes OLMo 3 as olmo2 with a sliding window
    write_tiny_gguf(hf, tmp_path / "olmo3-swa.gguf", "olmo2", customize=lambda w: w.add_sliding_window(8))
    with pytest.raises(GGUFConversionError, match="OLMo 3") as e:
        gguf_model_path(tmp_path / "olmo3-swa.gguf", tmp_path / "c")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tokenizer_rebuilt_equals_the_original(arch, converted):
    from tokenizers import Tokenizer

    hf, _, out = converted(arch)
    mine, theirs = Tokenizer.from_file(str(out / "tokenizer.json")), Tokenizer.from_file(f"{hf}/tokenizer.json")
    for text in ["hello world, what is two plus two?", "café ünïcode 1234", "<|im_start|>user\nhi<|im_end|>"]:
        assert mine.encode(text).ids == theirs.encode(text).ids


def test_pre_tokenizer_splits_per_llama_cpp_name():
    splits = {}
    for pre in ("qwen2", "llama-bpe", "smaug-bpe"):
        tok = gguf_convert._pre_tokenizer(pre, gguf_convert.Path("x.gguf"))
        splits[pre] = [piece for piece, _ in tok.pre_tokenize_str("It's 12345 ok")]
    assert splits["qwen2"] == ["It", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġok"]
    assert splits["llama-bpe"] == splits["smaug-bpe"] == ["It", "'s", "Ġ", "123", "45", "Ġok"]


def test_unknown_pre_tokenizer_and_architecture_refused_by_name(converted, tmp_path):
    hf, _, _ = converted("qwen3")
    bad = write_tiny_gguf(hf, tmp_path / "bad-pre.gguf", "qwen3", pre="deepseek-llm")
    with pytest.raises(GGUFConversionError, match="'deepseek-llm' is not supported") as e:
        gguf_model_path(bad, tmp_path / "c1")
    assert "\n" not in str(e.value)
    other = write_tiny_gguf(hf, tmp_path / "phi2.gguf", "phi2")
    with pytest.raises(GGUFConversionError, match="architecture 'phi2' is not supported"):
        gguf_model_path(other, tmp_path / "c2")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_a_sentencepiece_vocabulary_converts(arch, tmp_path):
    """Llama 2 / Mistral, Gemma 3 and Phi-3 GGUFs carry a SentencePiece vocabulary (``tokenizer.ggml.model``
    "llama": pieces with scores, byte-fallback tokens, no merges): rebuilt so that a prompt gets BOS, its pieces
    by merge rank and bytes for what the vocabulary lacks, and decodes back to its text; the same ids as
    transformers' own GGUF loader gives, and the model's logits those of the HF original."""
    import transformers

    tokens, _, _, special = spm_vocab(arch)
    if arch == "llama":
        hf = save_tiny_hf(tmp_path / "hf", "llama", vocab=len(tokens), layers=2)
    else:
        gemma = {"num_hidden_layers": 6, "final_logit_softcapping": None, "query_pre_attn_scalar": 16,  # as llama.cpp
                 "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}  # knows it (``_tiny_hf``)
        hf = save_tiny_family(tmp_path / "hf", arch, vocab_size=len(tokens), bos_token_id=special["bos"],
                              eos_token_id=special["eos"], pad_token_id=0,
                              **(gemma if arch == "gemma3" else {"num_hidden_layers": 2}))
    gguf_file = write_tiny_gguf(hf, tmp_path / f"spm-{arch}.gguf", arch, vocab="spm")
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping  # noqa: F401
    except ImportError:  # an older transformers: refused in one line naming the version to install
        with pytest.raises(GGUFConversionError, match="transformers>=5.25") as e:
            gguf_model_path(gguf_file, tmp_path / "cache" / "m")
        assert "\n" not in str(e.value)
        return
    out = gguf_model_path(gguf_file, tmp_path / "cache" / "m")
    ours = transformers.AutoTokenizer.from_pretrained(out)  # what we wrote, read by another library
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    for text in ("the theme is on", "them and the d\u00e9", "a  or"):
        ids = ours(text).input_ids
        assert ids[0] == special["bos"] and ids == theirs(text).input_ids, (arch, text, ids)
        assert ours.decode(ids, skip_special_tokens=True) == text
    assert tokens.index("\u2581theme") in ours("the theme").input_ids  # merged up to the piece, not letters
    assert "<0xC3>" in ours.convert_ids_to_tokens(ours("d\u00e9").input_ids)  # byte fallback
    target, ref = load_target(out), transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = torch.tensor([ours("the theme is on").input_ids])
    with torch.no_grad():
        assert (target.score(ids) - ref(ids).logits).abs().max().item() < 1e-4


def test_converted_once_then_reused(converted, monkeypatch):
    _, gguf_file, out = converted("qwen2")

    def fail(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    assert gguf_model_path(gguf_file, out) == out


def test_model_flag_takes_a_gguf(converted, tmp_path, monkeypatch):
    """``--model FILE.gguf`` (dspine-batch) and ``dspine info FILE.gguf``: the cache under $DSPINE_CACHE_DIR."""
    from click.testing import CliRunner

    from dspine.cli import main
    from dspine_batch.engines.models import resolve_model
    from dspine_batch.errors import UsageError

    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "cache"))
    _, gguf_file, _ = converted("gemma3")
    path = resolve_model(str(gguf_file))
    assert path.is_relative_to(tmp_path / "cache") and (path / "tokenizer.json").is_file()
    res = CliRunner().invoke(main, ["info", str(gguf_file)])
    assert res.exit_code == 0 and json.loads(res.output)["family"] == "gemma3"
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(UsageError, match="not a readable GGUF"):
        resolve_model(str(bad))
