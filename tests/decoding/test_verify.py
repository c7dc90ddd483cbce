"""Acceptance rule: greedy prefix matching, and the exact output law of one speculative-sampling step."""

from __future__ import annotations

import pytest
import torch

from dspine.decoding.verify import accept


def _onehot(ids, V):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_accepts_matching_prefix_and_respects_n_draft():
    V = 5
    p = _onehot([[1, 2, 3, 4]], V)  # target argmax after slots 0..3
    props = torch.tensor([[1, 2, 0]])
    u, uf = torch.rand(1, 3), torch.rand(1)  # greedy rows accept/reject whatever the uniforms are
    v = accept(p, props, None, torch.tensor([3]), u, uf)
    assert v.n_accepted.tolist() == [2] and v.tokens == [[1, 2, 3]]
    v = accept(p, props, None, torch.tensor([1]), u, uf)  # dynamic: only x_1 verified
    assert v.n_accepted.tolist() == [1] and v.tokens == [[1, 2]]
    v = accept(p, torch.tensor([[1, 2, 3]]), None, torch.tensor([3]), u, uf)
    assert v.tokens == [[1, 2, 3, 4]]
    v = accept(p, props, None, torch.tensor([0]), u, uf)  # ℓ = 0: a plain step, the argmax after slot 0
    assert v.n_accepted.tolist() == [0] and v.tokens == [[1]]
    v = accept(p[:, :1], props[:, :0], None, torch.tensor([0]), u[:, :0], uf)  # no drafted slots at all
    assert v.tokens == [[1]]


def test_single_step_output_law_is_p():
    """One drafted position: empirical law of the committed token == p for a q far from p."""
    V, n = 6, 40000
    p1 = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.1, 0.05])
    q1 = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(n // 1000):
        props = torch.multinomial(q1, 1000, replacement=True, generator=g)[:, None]
        p = torch.stack([p1, torch.full((V,), 1 / V)])[None].expand(1000, -1, -1)
        v = accept(
            p, props, q1[None, None].expand(1000, 1, V), torch.ones(1000, dtype=torch.long),
            torch.rand(1000, 1, generator=g), torch.rand(1000, generator=g),
        )
        for t in v.tokens:
            counts[t[0]] += 1
    freq = counts / n
    assert (freq - p1).abs().max() < 0.01


def test_proposal_outside_its_own_q_is_an_error():
    p = torch.full((1, 2, 4), 0.25)
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])
    v = accept(p, torch.tensor([[2]]), q, torch.tensor([1]), torch.rand(1, 1), torch.rand(1))
    with pytest.raises(RuntimeError, match="outside the support of its own q"):
        _ = v.tokens
    ok = accept(p, torch.tensor([[1]]), q, torch.tensor([1]), torch.rand(1, 1), torch.rand(1))
    assert len(ok.tokens[0]) in (1, 2)


def test_accept_greedy_equals_accept_with_one_hot_p():
    """The argmax-only path is the one-hot case of ``accept``, without the [B, L+1, V] tensor."""
    from dspine.decoding.verify import accept_greedy

    g = torch.Generator().manual_seed(0)
    B, L, V = 6, 5, 7
    logits = torch.randn(B, L + 1, V, generator=g)
    top = logits.argmax(-1)
    props = torch.where(torch.rand(B, L, generator=g) < 0.7, top[:, :L], torch.randint(0, V, (B, L), generator=g))
    ell = torch.tensor([0, 1, 5, 3, 5, 2])
    p = torch.nn.functional.one_hot(top, V).float()
    want = accept(p, props, None, ell, torch.rand(B, L, generator=g), torch.rand(B, generator=g))
    got = accept_greedy(top, props, ell)
    assert torch.equal(got.n_accepted, want.n_accepted)
    for b in range(B):
        k = int(want.n_accepted[b])
        assert got.committed[b, : k + 1].tolist() == want.committed[b, : k + 1].tolist()
