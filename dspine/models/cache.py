"""Explicit, batched caches for the reference targets and the draft.

A cache is a dataclass of plain tensors with the batch on dim 0, so a scheduler can drop finished rows
(``select``) and merge freshly prefilled requests into a running batch (``concat``) without knowing which
architecture produced it.

- ``KVCache``: keys/values ``[B, H_kv, capacity, D]`` for one attention layer; the row's valid length lives
  in the owning ``ModelCache.lengths``. Writes land at ``lengths[b] + t``; "crop" is a length change.
- ``SSMState``: Gated-DeltaNet conv window ``[B, C, K-1]`` and recurrent state ``[B, H_v, D_k, D_v]`` (fp32),
  plus, while a speculative verify is pending, the per-token inputs ReplaySSM needs to commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    k: torch.Tensor  # [B, H_kv, capacity, D]
    v: torch.Tensor  # [B, H_kv, capacity, D]

    @staticmethod
    def empty(batch: int, heads: int, capacity: int, head_dim: int, dtype, device) -> KVCache:
        shape = (batch, heads, capacity, head_dim)
        return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def ensure(self, needed: int, exact: bool = False) -> None:
        """Grow the time axis so positions < ``needed`` fit: doubling (writes one step at a time grow often), or to
        ``needed`` itself when the caller knows it is the final size (a newcomer's rows written into freed slots:
        doubling there left a batch cache twice the size its rows need for the rest of the job)."""
        if needed <= self.capacity:
            return
        new = needed if exact else max(needed, 2 * self.capacity)
        pad = new - self.capacity
        z = self.k.new_zeros(self.k.shape[0], self.k.shape[1], pad, self.k.shape[3])
        self.k = torch.cat([self.k, z], dim=2)
        self.v = torch.cat([self.v, z.clone()], dim=2)

    def write(
        self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upto: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Store k/v [B, H, T, D] at absolute positions pos [B, T] (per row).

        ``upto`` (= max(pos) + 1) and ``rows`` (= arange(B)[:, None]) may be passed in when the caller already
        has them (``layers.Positions``), saving a host sync and an allocation per layer.
        """
        self.ensure(int(pos.max()) + 1 if upto is None else upto)
        b = torch.arange(pos.shape[0], device=pos.device)[:, None] if rows is None else rows
        # advanced indices on dims 0 and 2 -> indexed shape is [B, T, H, D]
        self.k[b, :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[b, :, pos] = v.transpose(1, 2).to(self.v.dtype)

    def view(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :upto], self.v[:, :, :upto]

    def select(self, idx: torch.Tensor) -> KVCache:
        return KVCache(self.k[idx], self.v[idx])

    @staticmethod
    def concat(parts: list[KVCache]) -> KVCache:
        cap = max(p.capacity for p in parts)
        for p in parts:
            p.ensure(cap)
        return KVCache(torch.cat([p.k[:, :, :cap] for p in parts]), torch.cat([p.v[:, :, :cap] for p in parts]))


@dataclass
class SSMState:
    conv: torch.Tensor  # [B, C, K-1]  last K-1 conv inputs (C = 2*key_dim + value_dim)
    rec: torch.Tensor  # [B, H_v, D_k, D_v]  fp32 recurrent state
    # ReplaySSM record of the pending speculative forward (None when nothing is pending)
    pending: dict[str, torch.Tensor] | None = None

    def select(self, idx: torch.Tensor) -> SSMState:
        pend = None if self.pending is None else {k: v[idx] for k, v in self.pending.items()}
        return SSMState(self.conv[idx], self.rec[idx], pend)

    @staticmethod
    def concat(parts: list[SSMState]) -> SSMState:
        if any(p.pending is not None for p in parts):
            raise RuntimeError("cannot merge caches while a speculative verify is pending")
        return SSMState(torch.cat([p.conv for p in parts]), torch.cat([p.rec for p in parts]))


@dataclass
class ModelCache:
    """Per-layer state of one model for a batch of rows. ``lengths[b]`` = committed tokens of row b."""

    lengths: torch.Tensor  # LongTensor [B]
    layers: list[KVCache | SSMState] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def select(self, idx: torch.Tensor | list[int]) -> ModelCache:
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.lengths.device)
        return ModelCache(self.lengths[idx].clone(), [layer.select(idx) for layer in self.layers])

    @staticmethod
    def concat(parts: list[ModelCache]) -> ModelCache:
        if len(parts) == 1:
            return parts[0]
        layers = []
        for i in range(len(parts[0].layers)):
            kind = type(parts[0].layers[i])
            layers.append(kind.concat([p.layers[i] for p in parts]))
        return ModelCache(torch.cat([p.lengths for p in parts]), layers)
