"""Transfer space: fixed per-token codes derived from the target's LM head (``docs/design.md``, "The DSpine draft").

The draft tells slot ``i`` which token its predecessor is through ``code(token)``: a unit vector in a
rank-``r`` whitened principal subspace of the (row-normalised, mean-centred) head rows. Whitening makes
every direction count equally, so codes of unrelated tokens are close to orthogonal while tokens the head
treats alike stay close. The codes never train.

``eigh`` is not bit-stable across hardware and BLAS builds, so the codes are computed once (by
``init_draft``), **stored in the checkpoint**, and never recomputed at load. The draft refuses to run while
its ``transfer_ready`` flag is false.

Everything is computed in float64, streaming over the vocabulary in chunks so a 248k x 5120 head never has
to exist in float64 all at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_TINY = 1e-12


@dataclass
class TransferSpace:
    codes: torch.Tensor  # [V, r] float32, unit rows: code(v)
    directions: torch.Tensor  # [H, r] float64: D, columns = top-r eigenvectors (descending eigenvalue)
    eigenvalues: torch.Tensor  # [r] float64, descending (after the floor, see ``compute_transfer_space``)
    mean: torch.Tensor  # [H] float64: mu, mean of the normalised head rows


def max_transfer_rank(hidden_size: int, vocab_size: int) -> int:
    """The largest valid ``transfer_rank``: V centred points span at most V-1 directions, and at most H."""
    return min(hidden_size, vocab_size - 1)


def _normalised_rows(chunk: torch.Tensor) -> torch.Tensor:
    x = chunk.double()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_TINY)  # all-zero rows stay zero instead of NaN


def compute_transfer_space(head_weight: torch.Tensor, rank: int, chunk_rows: int = 16384) -> TransferSpace:
    """Codes from the target head E [V, H].

    1. ê_v = E_v / ‖E_v‖, mu = mean_v ê_v.
    2. C = cov(ê) (population covariance); eigh; keep the top ``rank`` eigenpairs (D [H, r], lambda [r]).
    3. code(v) = normalize((ê_v − mu) · D / sqrt(lambda)).

    Each eigenvector's sign is fixed (largest-magnitude entry positive) so the result does not depend on
    the sign convention of the eigensolver. Eigenvalues are floored at ``lambda_max * 1e-12``: a head whose
    numerical rank is below ``rank`` (e.g. duplicated rows) then gets finite codes with noise directions
    instead of infinities.
    """
    V, H = head_weight.shape
    if not 0 < rank <= max_transfer_rank(H, V):
        raise ValueError(f"transfer_rank {rank} out of range: need 0 < rank <= min(H={H}, V-1={V - 1})")
    dev = head_weight.device
    total = torch.zeros(H, dtype=torch.float64, device=dev)
    gram = torch.zeros(H, H, dtype=torch.float64, device=dev)
    with torch.no_grad():
        for chunk in head_weight.detach().split(chunk_rows):
            x = _normalised_rows(chunk)  # [n, H]
            total += x.sum(0)
            gram += x.T @ x
        mean = total / V
        cov = gram / V - torch.outer(mean, mean)
        cov = (cov + cov.T) / 2
        lam, vec = torch.linalg.eigh(cov)  # ascending
        lam = lam.flip(0)[:rank]
        vec = vec.flip(1)[:, :rank]  # [H, r]
        lam = lam.clamp_min(float(lam[0]) * 1e-12 if float(lam[0]) > 0 else _TINY)
        pivot = vec.abs().argmax(0)  # [r]
        sign = torch.sign(vec[pivot, torch.arange(rank, device=dev)])
        vec = vec * torch.where(sign == 0, torch.ones_like(sign), sign)
        whiten = vec / lam.sqrt()  # [H, r]
        codes = torch.empty(V, rank, dtype=torch.float32, device=dev)
        for i, chunk in enumerate(head_weight.detach().split(chunk_rows)):
            z = (_normalised_rows(chunk) - mean) @ whiten  # [n, r]
            z = z / z.norm(dim=-1, keepdim=True).clamp_min(_TINY)
            codes[i * chunk_rows : i * chunk_rows + z.shape[0]] = z.float()
    return TransferSpace(codes=codes, directions=vec, eigenvalues=lam, mean=mean)
