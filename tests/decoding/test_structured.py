"""Structured outputs and the processing seam (grammars, penalties, logit bias, min_tokens, logprobs) under
speculation: greedy speculative output is the plain output under the same grammar and penalties, on dense and
hybrid targets, with the draft, suffix matches and grammar-forced tokens proposing; sampled rows follow the
grammar-masked, penalised distribution exactly (χ² on the joint law of three tokens, against an exact law computed
here with xgrammar's own matcher and the penalty formulas written out); logprobs of a speculative run are a plain
run's."""

from __future__ import annotations

import json
import math

import pytest
import torch
import xgrammar
from helpers import JoiningScriptedDraft, joint3_counts, random_mistakes, token_prompts
from test_generate import CHEAP, WIDE, _chi2_pvalue, _random_dspine

from dspine import generate
from dspine.decoding.grammar import Grammars

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3}},
    "required": ["kind", "ok", "tags"],
}


def byte_grammars(vocab: int = 256) -> Grammars:
    """A tokenizer for the tiny byte-vocabulary test models: id i is byte i, id 0 the stop token."""
    words = ["</s>"] + [bytes([i]).decode("latin-1") for i in range(1, vocab)]
    info = xgrammar.TokenizerInfo(words, vocab_type=xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=[0])
    return Grammars(info, lambda s: list(s.encode("latin-1")), vocab)


def _json_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that show records of the schema's shape, so suffix matches have something to copy."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rec = json.dumps({"kind": ["alpha", "beta", "gamma"][i % 3], "ok": bool(i % 2), "tags": ["x", "yy"][: i % 3]})
        noise = torch.randint(1, 128, (5,), generator=g).tolist()
        out.append(noise + list(rec.encode()) + noise)
    return out


@pytest.fixture(params=["llama", "qwen3", "hybrid"])
def target(request, llama_target, qwen3_target, hybrid_target):
    return {"llama": llama_target, "qwen3": qwen3_target, "hybrid": hybrid_target}[request.param]


def test_greedy_under_a_schema_is_plain_with_every_proposer(target):
    from jsonschema import validate

    grammar = byte_grammars().get("json_schema", json.dumps(SCHEMA))
    prompts = _json_prompts(6, seed=1)
    kw = dict(max_new_tokens=70, stop_token_ids=[0], grammar=grammar)
    plain = generate(target, None, prompts, **kw)
    done = [bytes(o.token_ids[:-1]).decode() for o in plain if o.finish_reason == "stop"]
    assert done, "some rows end their JSON"
    for text in done:  # every finished row is a valid record (a reader we did not write)
        validate(json.loads(text), SCHEMA)
    spec = generate(target, _random_dspine(target, 4, seed=2), prompts, verify="cost", cost=CHEAP, prices="static",
                    proposers="auto", batch_size=3, **kw)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert [s.finish_reason for s in spec] == [p.finish_reason for p in plain]
    st = [s.stats for s in spec]
    assert sum(s.forced_accepted for s in st) > 0  # the grammar's forced tokens were proposed and kept
    assert all(s.forced_accepted <= s.forced_proposed for s in st)


def test_a_draft_that_breaks_the_grammar_is_cut_and_changes_nothing(llama_target):
    """A scripted draft proposing bytes the grammar refuses: the walk ends each verify at the first refused token
    (its slots are never computed), greedy output stays the plain output."""
    grammar = byte_grammars().get("regex", "[a-c]{2,6}(,[0-9]{1,3}){0,4}")
    prompts = token_prompts(4, 128, seed=5)
    kw = dict(max_new_tokens=30, stop_token_ids=[0], grammar=grammar)
    plain = generate(llama_target, None, prompts, **kw)
    for rate in (0.0, 0.5, 1.0):
        draft = JoiningScriptedDraft(prompts, [p.token_ids for p in plain], block_size=4,
                                     mistake=random_mistakes(9, rate))
        spec = generate(llama_target, draft, prompts, verify="fixed", batch_size=2, **kw)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def test_penalties_bias_and_min_tokens_greedy_equals_plain(target):
    prompts = token_prompts(5, target.vocab_size, seed=3)
    prompts = [p + p for p in prompts]  # text worth repeating: suffix matches propose it
    kw = dict(max_new_tokens=28, stop_token_ids=[7], presence_penalty=[0.0, 0.7, 0.0, 1.5, 0.3],
              frequency_penalty=[0.0, 0.0, 0.9, 0.4, 0.3], repetition_penalty=[1.0, 1.0, 1.3, 1.0, 1.5],
              logit_bias=[{}, {5: 2.0}, {}, {9: -100.0}, {11: 1.0}], min_tokens=[0, 0, 10, 0, 20])
    plain = generate(target, None, prompts, **kw)
    for o, m in zip(plain, kw["min_tokens"]):
        assert 7 not in o.token_ids[:m]
    spec = generate(target, _random_dspine(target, 4, seed=4), prompts, verify="cost", cost=CHEAP, prices="static",
                    proposers="auto", batch_size=2, **kw)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.verify_steps for s in spec) > 0
    assert all(9 not in o.token_ids for o in plain[3:4])  # a -100 bias never lets the id through greedily


def _oracle_greedy(target, prompt: list[int], n: int, stop: int, pres: float, freq: float, rep: float,
                   bias: dict[int, float], min_tokens: int) -> list[int]:
    """Greedy decoding written out here, one full forward per token (``target.score``), with the penalties,
    the bias and min_tokens applied by their formulas (``_penalised``): an oracle that shares nothing with the
    decoding loop's processing seam."""
    out: list[int] = []
    while len(out) < n:
        x = _penalised(target.score(torch.tensor([prompt + out]))[0, -1].double(), prompt, out, pres, freq, rep)
        for t, b in bias.items():
            x[t] += b
        if len(out) < min_tokens:
            x[stop] = -math.inf
        out.append(int(x.argmax()))
        if out[-1] == stop:
            break
    return out


def test_penalties_bias_and_min_tokens_follow_an_independent_oracle(llama_target):
    """Plain and speculative decoding share the processing seam, so their agreement alone cannot show a setting is
    honoured: each row here follows the oracle above, and each setting changes its row's output (a control: an
    ignored setting fails)."""
    target = llama_target
    prompts = [p + p for p in token_prompts(3, target.vocab_size, seed=11)]
    free = generate(target, None, prompts, max_new_tokens=16)
    stop = free[2].token_ids[1]  # row 2 would stop at its second token: min_tokens must hold it back
    rows = [dict(pres=0.8, freq=0.5, rep=1.4, bias={}, min_tokens=0),
            dict(pres=0.0, freq=0.0, rep=1.0, bias={5: 12.0, free[1].token_ids[0]: -100.0}, min_tokens=0),
            dict(pres=0.0, freq=0.0, rep=1.0, bias={}, min_tokens=9)]
    kw = dict(max_new_tokens=16, stop_token_ids=[stop], presence_penalty=[r["pres"] for r in rows],
              frequency_penalty=[r["freq"] for r in rows], repetition_penalty=[r["rep"] for r in rows],
              logit_bias=[r["bias"] for r in rows], min_tokens=[r["min_tokens"] for r in rows])
    plain = generate(target, None, prompts, **kw)
    bare = generate(target, None, prompts, max_new_tokens=16, stop_token_ids=[stop])
    for o, b, r, prompt in zip(plain, bare, rows, prompts):
        assert o.token_ids == _oracle_greedy(target, prompt, 16, stop, **r)
        assert o.token_ids != b.token_ids  # the control: the row's setting changed its output
    assert len(bare[2].token_ids) <= 2 and len(plain[2].token_ids) >= 9
    assert plain[1].token_ids.count(5) >= 4 and free[1].token_ids[0] not in plain[1].token_ids
    spec = generate(target, _random_dspine(target, 4, seed=4), prompts, verify="cost", cost=CHEAP, prices="static",
                    proposers="auto", batch_size=2, **kw)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.verify_steps for s in spec) > 0


def test_logprobs_of_a_speculative_run_are_a_plain_runs(llama_target):
    prompts = [p + p for p in token_prompts(4, 256, seed=6)]
    kw = dict(max_new_tokens=16, logprobs=3, temperature=[0.0, 0.8, 0.0, 1.0], seed=[1, 2, 3, 4])
    plain = generate(llama_target, None, prompts, **kw)
    spec = generate(llama_target, _random_dspine(llama_target, 4, seed=5), prompts, verify="cost", cost=CHEAP,
                    prices="static", proposers="auto", batch_size=3, **kw)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.verify_steps for s in spec) > 0
    for s, p, prompt in zip(spec, plain, prompts):
        assert s.logprobs == p.logprobs  # bit-equal: the kernels are batch invariant
        assert len(p.logprobs) == len(p.token_ids)
        # and they are the model's own: log-softmax of its raw logits at each position (an independent forward)
        raw = llama_target.score(torch.tensor([prompt + p.token_ids]))[0, len(prompt) - 1 : -1].log_softmax(-1)
        for (tok, lp, top), row, t in zip(p.logprobs, raw, p.token_ids):
            assert tok == t and lp == pytest.approx(float(row[t]), abs=1e-4)
            assert [i for i, _ in top] == row.topk(3).indices.tolist()


# -- the exact law under a grammar and penalties ---------------------------------------------------------------

LETTERS = "abcdefghijklmno"  # ids 0..14; id 15 is the stop token


def letter_grammars(vocab: int = 16) -> Grammars:
    words = list(LETTERS) + ["</s>"]
    info = xgrammar.TokenizerInfo(words, vocab_type=xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=[15])
    return Grammars(info, lambda s: [LETTERS.index(c) for c in s], vocab)


def _allowed(grammar, prefix: list[int], vocab: int) -> torch.Tensor:
    """The grammar's allowed ids after ``prefix``, from a fresh xgrammar matcher (bool [V])."""
    m = grammar.matcher()
    for t in prefix:
        assert m.accept_token(t)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(mask, 0)
    return torch.tensor([bool((int(mask[0, i // 32]) >> (i % 32)) & 1) for i in range(vocab)])


def _penalised(logits: torch.Tensor, prompt: list[int], out: list[int], pres: float, freq: float, rep: float):
    x = logits.clone()
    for t in set(prompt) | set(out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        x[t] -= pres + freq * out.count(t)
    return x


def _exact_joint3(target, prompt, grammar, pres, freq, rep):
    V = target.vocab_size
    law = torch.zeros(V, V, V, dtype=torch.float64)

    def dist(out):
        logits = target.score(torch.tensor([prompt + out]))[0, -1].double()
        x = _penalised(logits, prompt, out, pres, freq, rep)
        x[~_allowed(grammar, out, V)] = -math.inf
        return x.softmax(-1)

    p1 = dist([])
    for a in torch.nonzero(p1 > 0).flatten().tolist():
        p2 = dist([a])
        for b in torch.nonzero(p2 > 0).flatten().tolist():
            law[a, b] = p1[a] * p2[b] * dist([a, b])
    return law.flatten()


@pytest.mark.parametrize("pen", [(0.0, 0.0, 1.0), (0.6, 0.4, 1.4)], ids=["grammar", "grammar+penalties"])
def test_sampled_joint_of_three_tokens_under_a_grammar_matches_the_exact_law(small_vocab_target, pen):
    """Sampled rows under a regex whose second token is forced, with penalties: suffix matches and forced tokens
    propose (point masses), greedy neighbours verify the draft's block, rows join freed slots. The joint law of
    three sampled tokens is the exact grammar-masked, penalised law."""
    grammar = letter_grammars().get("regex", "[a-e]b[a-f][a-o]*")
    prompt = [0, 1, 2, 0, 1, 3, 0, 1, 2, 0, 1]
    exact = _exact_joint3(small_vocab_target, prompt, grammar, *pen)
    n, k = 12000, 1000
    outs = generate(small_vocab_target, _random_dspine(small_vocab_target, 4, seed=6), [prompt] * (n + k),
                    max_new_tokens=3, temperature=[1.0] * n + [0.0] * k, seed=list(range(n + k)), verify="cost",
                    cost=WIDE, prices="static", proposers="auto", batch_size=13, grammar=grammar, stop_token_ids=[15],
                    presence_penalty=pen[0], frequency_penalty=pen[1], repetition_penalty=pen[2])
    counts = joint3_counts(outs[:n], small_vocab_target.vocab_size)
    support = exact > 0  # the grammar leaves few sequences: nothing may fall outside them
    assert int(counts[~support].sum()) == 0
    assert _chi2_pvalue(counts[support], exact[support]) > 1e-3
    assert sum(o.stats.forced_accepted for o in outs[:n]) > n // 4  # the forced 'b' was proposed and kept
    assert all(o.token_ids[1] == 1 for o in outs)  # and the grammar holds on every row


def _drafted_under_grammar(target, grammar, prompt, pen, n: int):
    """``n`` sampled rows (temperature 1) whose every round is the DSpine draft's block (``proposers="dspine"``,
    fixed verify): the proposals are drawn from the draft's q, and the regex refuses most of what a random draft
    proposes for the second token."""
    return generate(target, _random_dspine(target, 4, seed=7), [prompt] * n, max_new_tokens=3,
                    temperature=1.0, seed=list(range(n)), verify="fixed", proposers="dspine", batch_size=16,
                    grammar=grammar, stop_token_ids=[15], presence_penalty=pen[0], frequency_penalty=pen[1],
                    repetition_penalty=pen[2])


DRAFT_GRAMMAR_CASES = [(0.0, 0.0, 1.0), (0.6, 0.4, 1.4)]


@pytest.mark.parametrize("pen", DRAFT_GRAMMAR_CASES, ids=["grammar", "grammar+penalties"])
def test_sampled_rows_verifying_the_drafts_q_under_a_grammar_match_the_exact_law(small_vocab_target, pen):
    """A proposal drawn from the draft's q that the grammar refuses is a rejection at that slot (the next token
    from the residual norm(max(p - q, 0))), not the end of the verify with a bonus drawn from p (issue 43: that
    gives the slot the law p + q(refused)(p - residual)). The joint law of three sampled tokens under the regex
    (and penalties) is the exact grammar-masked law computed here with xgrammar's own matcher."""
    grammar = letter_grammars().get("regex", "[a-c][d-f][a-o]*")
    prompt = [0, 3, 1, 4, 0, 3, 2, 5, 0, 3]
    exact = _exact_joint3(small_vocab_target, prompt, grammar, *pen)
    n = 12000
    outs = _drafted_under_grammar(small_vocab_target, grammar, prompt, pen, n)
    counts = joint3_counts(outs, small_vocab_target.vocab_size)
    support = exact > 0
    assert int(counts[~support].sum()) == 0
    assert _chi2_pvalue(counts[support], exact[support]) > 1e-3
    st = [o.stats for o in outs]
    proposed, accepted = sum(s.dspine_proposed for s in st), sum(s.dspine_accepted for s in st)
    assert sum(s.dspine_steps for s in st) >= n // 2  # the draft's blocks were verified ...
    assert accepted < 0.8 * proposed  # ... and the grammar refused a good part of what it drew


def test_the_old_grammar_cut_of_drawn_proposals_is_detected(small_vocab_target, monkeypatch):
    """Negative control: ending a drawn row's verify at the refused token (the bonus from p, as before the fix)
    biases the law, and the χ² test above sees it."""
    import dspine.decoding.rounds as rounds

    monkeypatch.setattr(rounds, "grammar_cut", lambda ell, cut, drawn: cut)
    grammar = letter_grammars().get("regex", "[a-c][d-f][a-o]*")
    prompt = [0, 3, 1, 4, 0, 3, 2, 5, 0, 3]
    exact = _exact_joint3(small_vocab_target, prompt, grammar, 0.0, 0.0, 1.0)
    outs = _drafted_under_grammar(small_vocab_target, grammar, prompt, DRAFT_GRAMMAR_CASES[0], 12000)
    counts = joint3_counts(outs, small_vocab_target.vocab_size)
    support = exact > 0
    assert int(counts[~support].sum()) == 0  # the grammar still holds: the bias is in the law, not the support
    assert _chi2_pvalue(counts[support], exact[support]) < 1e-6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_against_a_grammar_that_has_ended_lets_the_grammar_end(small_vocab_target, temperature):
    """``min_tokens`` past the grammar's end, with a one-token stop string the grammar refuses (id 3, 'd') among
    the stop ids: the grammar's end wins (the row stops with the grammar's stop, id 15, after two letters), plain
    and speculative alike; before, every stop id got logit 0, greedy took id 3, the grammar refused it and the
    commit raised (a job death in the batch tool)."""
    grammar = letter_grammars().get("regex", "[a-c]{2}")
    prompts = [[0, 1, 2, 0, 1], [2, 2, 1, 0, 4, 5]]
    kw = dict(max_new_tokens=8, min_tokens=6, stop_token_ids=[15, 3], grammar=grammar, temperature=temperature,
              seed=[1, 2])
    plain = generate(small_vocab_target, None, prompts, **kw)
    spec = generate(small_vocab_target, _random_dspine(small_vocab_target, 4, seed=8), prompts, verify="fixed",
                    proposers="dspine", **kw)
    for o in plain:
        assert len(o.token_ids) == 3 and o.token_ids[-1] == 15 and o.finish_reason == "stop"
        assert all(t in (0, 1, 2) for t in o.token_ids[:2])
    if temperature == 0.0:
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    else:
        assert all(s.token_ids[-1] == 15 and len(s.token_ids) == 3 for s in spec)
