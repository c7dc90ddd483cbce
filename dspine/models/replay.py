"""ReplaySSM: rolling Gated-DeltaNet state back after a speculative verify (``docs/design.md``, "ReplaySSM").

Full-attention layers roll back by cropping (a length change), but a GDN layer's conv window and recurrent
state cannot be cropped, and storing the state after every draft position costs ``H_v * D_k * D_v`` fp32 per
position per layer (about 150 MB per position on a 27B-class target). Instead:

- **checkpoint**: a speculative forward leaves ``SSMState.conv`` / ``SSMState.rec`` untouched, so the state
  object itself *is* the pre-verify checkpoint (fp32 recurrent state, conv window); nothing is copied;
- **record** (:func:`record`): per token, the conv input ``u_t`` and the prepared update inputs
  ``(k_t, v_t, g_t, beta_t)`` that :func:`dspine.models.gdn.delta_rule_step` consumes (q only feeds the output, so it
  is not kept). This lives in ``SSMState.pending`` and follows ``select`` like any batch tensor;
- **commit** (:func:`commit`): replay the first ``n[b]`` recorded steps per row from the checkpoint with the
  same scan the direct path uses (state frozen past ``n[b]``), and rebuild the conv window as the last K-1 of
  ``old window ++ u_0 .. u_{n[b]-1}``.

Because the committed state comes from the same function applied to the same inputs in the same order, it
is bit-identical to a non-speculative forward of the same T tokens with ``n_valid = n`` (the masked path):
see ``tests/models/test_replay.py``.
"""

from __future__ import annotations

import torch

from dspine.models.cache import SSMState
from dspine.models.gdn import delta_rule_scan, roll_window


def record(
    state: SSMState,
    conv_in: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> None:
    """Keep what a commit needs from one speculative forward of T tokens over this layer.

    conv_in [B, C, T] (model dtype); k [B, T, H_k, D_k], v [B, T, H_v, D_v], g/beta [B, T, H_v] (fp32, prepared:
    k L2-normalised). ``state.conv``/``state.rec`` must be left as they were (they are the checkpoint).
    """
    if state.pending is not None:
        raise RuntimeError("a speculative forward is already pending on this state; commit it first")
    state.pending = {"conv_in": conv_in, "k": k, "v": v, "g": g, "beta": beta}


def commit(state: SSMState, n: torch.Tensor) -> None:
    """Advance the checkpoint over the first ``n[b]`` recorded tokens of each row (0 <= n[b] <= T) and clear
    the record. ``n`` is the accepted count *including* the bonus token (the decoding loop always has n >= 1).
    """
    rec = state.pending
    if rec is None:
        raise RuntimeError("commit without a pending speculative forward")
    T = rec["k"].shape[1]
    n = n.to(device=state.rec.device, dtype=torch.long)
    if n.shape != (state.rec.shape[0],):
        raise ValueError(f"commit: n has shape {list(n.shape)}, expected [{state.rec.shape[0]}]")
    if bool((n < 0).any()) or bool((n > T).any()):
        raise ValueError(f"commit: accepted counts {n.tolist()} outside [0, {T}]")
    steps = int(n.max()) if n.numel() else 0
    if steps > 0:
        valid = torch.arange(steps, device=n.device)[None, :] < n[:, None]  # [B, steps]
        state.rec, _ = delta_rule_scan(
            state.rec,
            rec["k"][:, :steps],
            rec["v"][:, :steps],
            rec["g"][:, :steps],
            rec["beta"][:, :steps],
            valid=valid,
        )
    state.conv = roll_window(state.conv, rec["conv_in"], n)
    state.pending = None
