"""xgrammar's per-tokenizer and per-grammar work in the per-machine cache (``dspine.decoding.grammar_cache``):
a warm start gives the same masks as a cold compile without loading the tokenizer through transformers, and a
torn, altered or unreadable entry is rebuilt, never trusted."""

from __future__ import annotations

import json

import pytest
import xgrammar

from dspine.decoding import grammar_cache
from dspine.decoding.grammar import Grammars

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                     "required": ["name", "n"]})


@pytest.fixture
def tok_dir(tmp_path_factory):
    """A small real HF tokenizer directory (byte-level BPE trained here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"name": "ada", "n": 12}', "hello world", "tides and moons"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(path))
    return path


def _masks(g: Grammars, text: str) -> list[list[int]]:
    """The allowed-token masks of a JSON text walked token by token (the grammar's behaviour, compared whole)."""
    m = g.get("json_schema", SCHEMA).matcher()
    out = []
    mask = xgrammar.allocate_token_bitmask(1, g.vocab_size)
    for t in g.encode(text):
        m.fill_next_token_bitmask(mask, 0)
        out.append(mask[0].tolist())
        assert m.accept_token(t)
    return out


def _grammars(tok_dir) -> Grammars:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    return Grammars.for_hf_dir(str(tok_dir), len(hf), [hf.eos_token_id],
                               lambda s: hf.encode(s, add_special_tokens=False))


def test_a_warm_start_gives_the_cold_masks_without_transformers(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "cache"))
    text = '{"name": "ada", "n": 12}'
    cold = _masks(_grammars(tok_dir), text)
    entries = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "grammar").iterdir())
    assert entries == ["compiled", "tokenizer"]
    import transformers

    def refuse(*a, **k):
        raise AssertionError("a warm start must not load the tokenizer through transformers")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    built = []
    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", lambda *a, **k: built.append(1))
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    warm = Grammars.for_hf_dir(str(tok_dir), len(hf), [hf.convert_tokens_to_ids("</s>")],
                               lambda s: hf.encode(s, add_special_tokens=False))
    assert _masks(warm, text) == cold and not built  # nothing compiled: both came from the cache


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_entry_is_rebuilt_never_trusted(tok_dir, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "cache"))
    text = '{"name": "ada", "n": 12}'
    cold = _masks(_grammars(tok_dir), text)
    for entry in (tmp_path / "cache" / "grammar").iterdir():
        raw = entry.read_bytes()
        if damage == "flip":  # a valid-looking body that no longer matches its checksum
            i = raw.index(b"\n") + len(raw) // 2
            raw = raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:]
        elif damage == "truncate":
            raw = raw[: len(raw) // 2]
        else:  # a body with a matching checksum that xgrammar cannot read
            body = b"{not json"
            import hashlib

            raw = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        entry.write_bytes(raw)
    assert _masks(_grammars(tok_dir), text) == cold
    for entry in (tmp_path / "cache" / "grammar").iterdir():  # rewritten whole
        assert grammar_cache._read(entry) is not None


def test_the_key_follows_what_the_info_depends_on(tok_dir):
    k = grammar_cache.tokenizer_key(tok_dir, 300, [0])
    assert grammar_cache.tokenizer_key(tok_dir, 301, [0]) != k and grammar_cache.tokenizer_key(tok_dir, 300, [1]) != k
    (tok_dir / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text() + " ")
    assert grammar_cache.tokenizer_key(tok_dir, 300, [0]) != k
