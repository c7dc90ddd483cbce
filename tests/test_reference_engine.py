"""The reference engine (dspine.generate) and its tokenizer/chat template, on a tiny random model.

The chat template is checked against transformers' ``apply_chat_template`` (the semantics we promise);
the engine against direct ``dspine.generate`` calls. The embedded SmolLM2 run is ``slow``.
"""

from __future__ import annotations

import json

import pytest
from batch_helpers import read_output, write_jsonl
from conftest import save_tiny_hf

from dspine_batch.cli import main
from dspine_batch.engine import Request, SamplingParams
from dspine_batch.tokenizer import HFTokenizer

SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
FANCY_TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
                  "{% set messages = messages[1:] %}{% else %}{% set sys = 'none' %}{% endif %}"
                  "[SYS {{ sys | tojson }}]\n"
                  "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                  "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
                  "  {{ m['role'] | upper }}: {{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}\nASSISTANT:{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def _tokenizer_dir(path, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, what is two plus two? the answer is four. café ünïcode"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": template}))
    return tok.get_vocab_size()


MESSAGES = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "be brief, café"}, {"role": "user", "content": " what is two plus two? "},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "ünïcode"}],
]


@pytest.mark.parametrize("template", [SMOL_TEMPLATE, FANCY_TEMPLATE])
def test_chat_template_matches_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    _tokenizer_dir(tmp_path, template)
    ours = HFTokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for msgs in MESSAGES:
        text = theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours.render(msgs) == text
        assert ours.render_chat(msgs) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode("hello world") == theirs.encode("hello world")
    assert ours.eos_ids()[0] == theirs.eos_token_id


def test_template_errors_are_row_errors(tmp_path):
    _tokenizer_dir(tmp_path, FANCY_TEMPLATE)
    with pytest.raises(ValueError, match="bad role tool"):
        HFTokenizer(tmp_path).render([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama target with a tokenizer, and a random DSpine draft for it."""
    import torch

    from dspine import init_draft, load_target

    d = tmp_path_factory.mktemp("tiny")
    vocab = _tokenizer_dir(d, SMOL_TEMPLATE)
    save_tiny_hf(d, "llama", vocab=vocab, layers=2, max_position_embeddings=96)
    torch.manual_seed(0)
    draft_dir = tmp_path_factory.mktemp("tiny_draft")
    init_draft(load_target(d), num_layers=1, block_size=4).save(draft_dir)
    return d, draft_dir


def _engine(tiny, draft=True, **args):
    from dspine_batch.reference_engine import ReferenceEngine

    model, draft_dir = tiny
    return ReferenceEngine.load(str(model), str(draft_dir) if draft else "none", args)


def _requests(engine, n=4, **p):
    texts = ["hello world", "what is two plus two?", "the answer", "café", "four"]
    return [Request(f"r{i}", 0, engine.tokenizer.render_chat([{"role": "user", "content": texts[i % 5]}]),
                    SamplingParams(max_new_tokens=5, stop_token_ids=engine.tokenizer.stop_token_ids([]), **p))
            for i in range(n)]


def test_engine_matches_dspine_generate_and_reports_stats(tiny):
    from dspine import generate

    eng = _engine(tiny, batch_size="8")
    reqs = _requests(eng)
    got = list(eng.run(iter(reqs), max_in_flight=8))
    want = generate(eng.target, eng.draft, [r.prompt_ids for r in reqs], max_new_tokens=5,
                    stop_token_ids=list(reqs[0].params.stop_token_ids))
    assert [r.token_ids for r in got] == [w.token_ids for w in want]
    assert all(r.verify_steps and r.accept_histogram and len(r.accept_histogram) == 5 for r in got)
    assert all(r.finish_reason in ("stop", "length") and r.error is None for r in got)
    plain = list(_engine(tiny, draft=False).run(iter(reqs), 8))
    assert [r.token_ids for r in plain] == [r.token_ids for r in got]  # lossless: same greedy output
    assert all(r.verify_steps is None and r.accept_length is None for r in plain)


def test_dynamic_threshold_engine_arg(tiny, tmp_path):
    """``--engine-arg dynamic_threshold=X`` stops proposals early with a fitted confidence head (same greedy
    output, fewer drafts); without a fitted head it is ignored; a non-number is a usage error."""
    import torch

    from dspine import load_draft
    from dspine_batch.errors import UsageError

    model, draft_dir = tiny
    d = load_draft(draft_dir)
    with torch.no_grad():
        d.confidence_head.proj.weight.zero_()
        d.confidence_head.proj.bias.fill_(-2.0)  # c = 0.12 everywhere: below 0.5, so every proposal stops at 0
    d.confidence_trained = True
    d.save(tmp_path / "fitted")
    reqs = _requests(_engine(tiny))
    full = list(_engine(tiny).run(iter(reqs), 8))
    cut = list(_engine((model, tmp_path / "fitted"), dynamic_threshold="0.5").run(iter(reqs), 8))
    assert [r.token_ids for r in cut] == [r.token_ids for r in full]
    assert all(r.draft_tokens_proposed == 0 for r in cut) and all(r.draft_tokens_proposed > 0 for r in full)
    unfitted = _engine(tiny, dynamic_threshold="0.5")
    assert unfitted.dynamic_threshold is None and "dynamic_threshold" not in unfitted.identity()
    with pytest.raises(UsageError, match="expected a number"):
        _engine(tiny, dynamic_threshold="high")


def test_decode_json_defaults_and_overrides(tiny, tmp_path):
    """A draft's decode.json sets block_size/dynamic_threshold unless --engine-arg does; bad values are usage
    errors naming the file."""
    import json
    import shutil

    from dspine_batch.errors import UsageError

    model, draft_dir = tiny
    d = tmp_path / "draft"
    shutil.copytree(draft_dir, d)
    (d / "decode.json").write_text(json.dumps({"_measured": "BENCHMARKS.md", "block_size": 3}))
    assert _engine((model, d)).block_size == 3
    assert _engine((model, d), block_size="4").block_size == 4
    assert _engine((model, d)).identity()["block_size"] == 3
    with pytest.raises(UsageError, match="supports 2..4"):
        _engine((model, d), block_size="9")
    (d / "decode.json").write_text(json.dumps({"block_size": "eight"}))
    with pytest.raises(UsageError, match=r"decode\.json: block_size must be an integer"):
        _engine((model, d))
    (d / "decode.json").write_text(json.dumps({"speed": 1}))
    with pytest.raises(UsageError, match="unknown key 'speed'"):
        _engine((model, d))


def test_per_request_sampling_and_bounded_batches(tiny):
    eng = _engine(tiny, draft=False, batch_size="2")
    reqs = _requests(eng, n=3, temperature=1.0, seed=3)
    a = [r.token_ids for r in eng.run(iter(reqs), 8)]
    b = [r.token_ids for r in eng.run(iter(reqs), 1)]  # different batching, same seeds -> same samples
    assert a == b
    pulled = []

    def feed():
        for r in reqs:
            pulled.append(r.row_id)
            yield r

    it = eng.run(feed(), 8)
    next(it)
    assert len(pulled) == 2  # batch_size bounds admission


def test_overlong_request_fails_alone(tiny):
    eng = _engine(tiny, draft=False)
    reqs = _requests(eng, n=3)
    reqs[1].prompt_ids = reqs[1].prompt_ids * 10  # longer than the 96-token context
    out = list(eng.run(iter(reqs), 8))
    assert out[0].error is None and out[2].error is None
    assert "engine rejected the request" in out[1].error


def test_embedded_draft_only_with_the_embedded_model(tiny, capsys, monkeypatch):
    from dspine import embedded
    from dspine_batch.reference_engine import ReferenceEngine, resolve_draft

    eng = ReferenceEngine.load(str(tiny[0]), "embedded", {})  # the default --draft with a custom model
    assert eng.draft is None and "pairs only with --model embedded" in capsys.readouterr().err

    def missing():
        raise FileNotFoundError("not shipped")

    monkeypatch.setattr(embedded, "embedded_draft_path", missing, raising=False)
    assert resolve_draft("embedded", "embedded") is None
    assert "no embedded draft is available (not shipped)" in capsys.readouterr().err
    assert resolve_draft("none", "embedded") is None and resolve_draft(str(tiny[1]), "x") == tiny[1]


def test_cli_on_the_reference_engine(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("DSPINE_BATCH_TEST_ENGINE", raising=False)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello world"},
                                               {"id": "b", "messages": None, "prompt": "two plus two"}])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["generate", str(src), "-o", str(out), "--engine", "reference", "--model", str(tiny[0]),
              "--draft", str(tiny[1]), "--max-new-tokens", "5", "--progress", "none", "--stop", "the"])
    assert e.value.code == 0
    rows = read_output(out)
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["verify_steps"] for r in rows)
    assert all("the" not in (r["output"] or "") for r in rows)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["fingerprint_fields"]["engine"]["draft"]["path"] == str(tiny[1])


@pytest.mark.slow
def test_embedded_model_end_to_end(tmp_path, monkeypatch):
    try:
        from dspine.embedded import embedded_target_path

        embedded_target_path()
    except Exception as e:  # not installed here
        pytest.skip(f"embedded model unavailable: {e}")
    monkeypatch.delenv("DSPINE_BATCH_TEST_ENGINE", raising=False)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "q", "prompt": "What is 2+2?"}])
    with pytest.raises(SystemExit) as e:
        main(["generate", str(src), "-o", str(tmp_path / "out"), "--max-new-tokens", "8", "--progress", "none"])
    assert e.value.code == 0
    (row,) = read_output(tmp_path / "out")
    assert row["status"] == "ok" and row["output"] and row["completion_tokens"] <= 8
