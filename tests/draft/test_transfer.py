"""Transfer space: codes from the target head, readouts = D^T, stored (never recomputed), gated by a flag."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspine.draft.io import init_draft, load_draft
from dspine.draft.transfer import compute_transfer_space, max_transfer_rank
from dspine.models.registry import load_target

transformers = pytest.importorskip("transformers")

V, H = 256, 64


def _head(V=V, H=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    # anisotropic rows, like a real LM head: a few dominant directions
    return torch.randn(V, H, generator=g) * torch.logspace(0, -1.5, H) + 0.3 * torch.randn(H, generator=g)


def _reference(E: torch.Tensor, r: int):
    """Straight float64 formulas, no chunking: (codes, D, lambda, mu)."""
    e = E.double()
    e = e / e.norm(dim=1, keepdim=True)
    mu = e.mean(0)
    x = e - mu
    lam, vec = torch.linalg.eigh(x.T @ x / E.shape[0])
    lam, vec = lam.flip(0)[:r], vec.flip(1)[:, :r]
    z = x @ vec / lam.sqrt()
    return z / z.norm(dim=1, keepdim=True), vec, lam, mu


def test_codes_are_unit_whitened_principal_coordinates():
    E = _head()
    sp = compute_transfer_space(E, 16)
    assert sp.codes.shape == (V, 16) and sp.codes.dtype == torch.float32
    torch.testing.assert_close(sp.codes.norm(dim=1), torch.ones(V))
    assert (sp.eigenvalues[:-1] >= sp.eigenvalues[1:]).all()  # descending
    torch.testing.assert_close(sp.directions.T @ sp.directions, torch.eye(16, dtype=torch.float64))
    ref_codes, ref_vec, ref_lam, ref_mu = _reference(E, 16)
    torch.testing.assert_close(sp.eigenvalues, ref_lam)
    torch.testing.assert_close(sp.mean, ref_mu)
    sign = torch.sign((sp.directions * ref_vec).sum(0))  # eigenvectors agree up to sign
    torch.testing.assert_close(sp.directions, ref_vec * sign)
    torch.testing.assert_close(sp.codes, (ref_codes * sign).float(), atol=1e-6, rtol=1e-6)
    # sign convention: each direction's largest-magnitude entry is positive
    idx = sp.directions.abs().argmax(0)
    assert (sp.directions[idx, torch.arange(16)] > 0).all()


def test_full_rank_whitening_is_identity_covariance():
    E = _head()
    sp = compute_transfer_space(E, H)
    e = E.double() / E.double().norm(dim=1, keepdim=True)
    z = (e - sp.mean) @ sp.directions / sp.eigenvalues.sqrt()
    torch.testing.assert_close(z.T @ z / V, torch.eye(H, dtype=torch.float64), atol=1e-8, rtol=1e-8)


def test_chunking_and_scale_do_not_matter():
    E = _head()
    a = compute_transfer_space(E, 12)
    b = compute_transfer_space(E, 12, chunk_rows=7)
    torch.testing.assert_close(a.codes, b.codes, atol=1e-6, rtol=0)
    c = compute_transfer_space(E * torch.rand(V, 1) * 10 + 0, 12)  # rows are normalised first
    torch.testing.assert_close(a.codes, c.codes, atol=1e-5, rtol=0)


def test_rank_limits_and_degenerate_heads():
    assert max_transfer_rank(64, 256) == 64 and max_transfer_rank(64, 16) == 15
    for bad in (0, H + 1):
        with pytest.raises(ValueError, match="transfer_rank"):
            compute_transfer_space(_head(), bad)
    with pytest.raises(ValueError, match="V-1=15"):
        compute_transfer_space(_head(V=16), 16)
    small = compute_transfer_space(_head(V=16), 15)  # V-1 centred points span 15 directions
    torch.testing.assert_close(small.codes.norm(dim=1), torch.ones(16))
    E = _head()[:20].repeat(13, 1)[:V]  # duplicated rows: numerical rank 19 < requested 64
    E[5] = 0  # and an all-zero row (e.g. an unused token)
    sp = compute_transfer_space(E, H)
    assert torch.isfinite(sp.codes).all() and torch.isfinite(sp.eigenvalues).all()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_transfer")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=H, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=V, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


KW = dict(num_layers=2, block_size=4, transfer_rank=16, message_size=16, top_k=4, intermediate_size=64)


def test_init_stores_codes_and_readouts_are_d_transpose(target):
    draft = init_draft(target, **KW)
    sp = compute_transfer_space(target.head_weight, 16)
    assert bool(draft.transfer_ready)
    assert torch.equal(draft.transfer_codes, sp.codes)
    for readout in draft.injection.readouts:
        assert torch.equal(readout.weight, sp.directions.T.float())
    torch.testing.assert_close(draft.transfer_codes.norm(dim=1), torch.ones(V))


def test_codes_and_flag_survive_save_load_and_are_never_recomputed(target, tmp_path):
    draft = init_draft(target, **KW)
    with torch.no_grad():  # stored codes win even when they are not what the head would give
        draft.transfer_codes.copy_(torch.roll(draft.transfer_codes, 1, dims=0))
    draft.save(tmp_path)
    back = load_draft(tmp_path)
    assert bool(back.transfer_ready) and torch.equal(back.transfer_codes, draft.transfer_codes)


def test_transfer_ready_false_refuses_to_run(target, tmp_path):
    draft = init_draft(target, **KW)
    draft.save(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["transfer_ready"] = torch.tensor(False)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = load_draft(tmp_path)
    assert not bool(back.transfer_ready)
    cache = back.new_cache(1, 8)
    back.extend_context(cache, torch.randn(1, 3, back.fc.in_features), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="transfer_ready is false"):
        back.propose(cache, torch.tensor([1]), target, torch.zeros(1), [None])
    with pytest.raises(RuntimeError, match="transfer_ready is false"):
        back.backbone(cache, torch.tensor([1]), target)
    back.save(tmp_path / "again")  # the flag itself round-trips
    assert not bool(load_draft(tmp_path / "again").transfer_ready)
