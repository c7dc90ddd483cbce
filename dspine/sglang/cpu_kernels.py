"""Torch versions of the ``sgl_kernel`` CPU ops and Triton kernels SGLang 0.5.23 calls on a CPU (a test/dev path).

The kernel package on the package index is the CUDA build; on a machine without a GPU driver its import fails
(``libcuda.so.1``), while SGLang's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports ops from it at module import
time, either as Python functions (``from sgl_kernel import ...``, ``from sgl_kernel.mamba import ...``) or as
registered torch ops (``torch.ops.sgl_kernel.<name>``). ``dspine.sglang.stand_in`` exposes the functions under
the name ``sgl_kernel`` and registers the torch ops (``register_torch_ops``) only when the real package cannot
import (see ``dspine.sglang.cpu``). Triton kernels have no CPU driver at all; ``dspine.sglang.cpu`` routes CPU
tensors to the torch versions here and leaves CUDA tensors to the kernels.

Sections: the request-to-token table / KV pool ops (dense and hybrid targets); chain acceptance (sampled
verify); the Qwen3.5 layer ops (gated attention norms and gate, GDN input split); the Gated DeltaNet ops
(conv, gates, recurrence; prefill and decode); the GDN ReplaySSM ring (verify, cursor advance, fold, conv-window
rollback). Each does what SGLang's kernel of the same name does to the same tensors (same shapes, layouts and
in-place effects), with plain tensor indexing and Python loops over requests: speed is irrelevant on the tiny
models the CPU tests run. The Gated DeltaNet math itself is ``dspine.models.gdn``'s (our reference target's), so a
state SGLang commits here is computed by the same step function our reference engine uses.

Layouts (SGLang's): a GDN recurrent state is ``[HV, V, K]`` (``dspine.models.gdn`` keeps ``[H_v, D_k, D_v]``: the
transpose); a conv state is ``[dim, K - 1]`` (the last K-1 conv inputs, oldest first); pool tensors carry a
slot (and sometimes a layer) dimension in front.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from dspine.models.gdn import (
    causal_conv,
    decay_add,
    delta_rule_read,
    delta_rule_scan,
    delta_rule_update,
    gated_rmsnorm,
    gates,
    prepare_qk,
    roll_window,
)


def _per_request_slots(starts: torch.Tensor, ends: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(s), int(e)) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """req_to_token[req, start:end] = the next (end - start) entries of out_cache_loc, request by request."""
    pos = 0
    for req, (s, e) in zip(req_pool_indices.tolist(), _per_request_slots(start_offset, end_offset), strict=True):
        n = e - s
        req_to_token[int(req), s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """The inverse gather: out_cache_loc (packed per request) = req_to_token[req, start:end]."""
    pos = 0
    for req, (s, e) in zip(req_pool_indices.tolist(), _per_request_slots(start_offset, end_offset), strict=True):
        n = e - s
        out_cache_loc[pos : pos + n] = req_to_token[int(req), s:e].to(out_cache_loc.dtype)
        pos += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """out_cache_loc[i*topk*num_steps : ...] = req_to_token[req_i, seq_len_i : seq_len_i + topk*num_steps]."""
    n = int(topk) * int(num_steps)
    for i, (req, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[int(req), int(s) : int(s) + n].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every pool buffer (raw base pointer + row stride in bytes): row[tgt] = row[src] (reads first, so
    overlapping moves are safe)."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        base, stride = int(base), int(stride)
        rows = [ctypes.string_at(base + int(s) * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + int(t) * stride, row, stride)


def chain_speculative_sampling(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                               candidates: torch.Tensor, retrive_index: torch.Tensor, uniform_samples: torch.Tensor,
                               uniform_samples_final: torch.Tensor, target_probs: torch.Tensor,
                               draft_probs: torch.Tensor) -> None:
    """Chain rejection sampling (Leviathan et al.), SGLang's ``chain_speculative_sampling_triton`` in torch.

    Row b walks its chain: draft token x at step s (candidates[b, s]) is accepted when u * q(x) < p(x) with
    q(x) a probability; the first rejection (or the end of the chain) samples the correction/bonus token by
    inverse CDF from max(p - q, 0) (p alone when every draft was accepted). Writes the accepted tokens and the
    final one into ``predicts`` at the chain's flat indices, the accepted indices into ``accept_index`` and
    the number of accepted drafts into ``accept_token_num`` (the same outputs as the kernel).
    """
    bs, slots = candidates.shape
    vocab = target_probs.shape[-1]
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        n = 0
        for step in range(1, slots):
            tok = int(candidates[b, step])
            p = float(target_probs[b, step - 1, tok])
            q = float(draft_probs[b, step - 1, tok])
            if not (0.0 < q <= 1.0 and float(uniform_samples[b, step - 1]) * q < p):
                break
            n += 1
            predicts[last] = tok
            last = int(retrive_index[b, step])
            accept_index[b, n] = last
        accept_token_num[b] = n
        p_row = target_probs[b, n].double()
        if n == slots - 1:
            mass = p_row
        else:
            q_row = draft_probs[b, n].double()
            q_row = torch.where((q_row >= 0) & (q_row <= 1), q_row, torch.zeros_like(q_row))
            mass = (p_row - q_row).clamp_min(0)
        cdf = mass.cumsum(0)
        hit = (cdf > float(uniform_samples_final[b]) * float(cdf[-1])).nonzero()
        predicts[last] = int(hit[0]) if len(hit) else vocab - 1


# -- Qwen3.5 layer ops (``sglang.srt.models.qwen3_5`` binds them from ``torch.ops.sgl_kernel`` on the CPU) --------


def _gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim in fp32, ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, as
    ``dspine.models.layers.RMSNorm(offset=1.0)``; returns the input dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """Replaces the CPU kernel of the gated-attention output gate: ``x *= sigmoid(gate)`` in place.

    x [T, H*D] (attention output); gate [T, H*D] or a strided [T, H, D] view of the q projection (SGLang keeps
    it as a view, see ``Qwen3_5`` ``forward_prepare_native``).
    """
    x.mul_(torch.sigmoid(gate.float()).reshape(x.shape).to(x.dtype))


def fused_qk_gemma_rmsnorm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               eps: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replaces the CPU kernel of the per-head q/k norms: zero-centred RMSNorm of every ``head_dim`` row of q and
    of k -> (q_rows [*, head_dim], k_rows [*, head_dim]), contiguous (the caller views them back)."""
    return (_gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps).contiguous(),
            _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps).contiguous())


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                         k_weight: torch.Tensor, eps: float, head_dim: int,
                                         num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replaces the CPU kernel that splits the gated q projection and norms q/k in one pass.

    q_gate [T, num_heads * 2 * head_dim] holds per head ``[query | gate]`` (the Qwen3.5 layout, as
    ``dspine.models.qwen3_5.GatedAttention``); k [T, num_kv_heads * head_dim] -> (q [T*num_heads, head_dim] normed,
    k [T*num_kv_heads, head_dim] normed, gate [T*num_heads, head_dim] copied), all contiguous.
    """
    qg = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    return (_gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps).contiguous(),
            _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps).contiguous(),
            gate.reshape(-1, head_dim).contiguous())


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor,
                                                  num_heads_qk: int, num_heads_v: int, head_qk: int,
                                                  head_v: int) -> tuple[torch.Tensor, ...]:
    """Replaces the CPU kernel that unpacks the GDN input projections (Qwen3.5's contiguous layout).

    mixed_qkvz [T, q | k | v | z] (``in_proj_qkv`` then ``in_proj_z``), mixed_ba [T, b | a] -> (mixed_qkv
    [T, q | k | v] (the conv input), z [T, num_heads_v, head_v], b [T, num_heads_v], a [T, num_heads_v]), all
    contiguous copies.
    """
    T = mixed_qkvz.shape[0]
    qkv = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    z = mixed_qkvz[:, qkv : qkv + num_heads_v * head_v].reshape(T, num_heads_v, head_v)
    return (mixed_qkvz[:, :qkv].contiguous(), z.contiguous(), mixed_ba[:, :num_heads_v].contiguous(),
            mixed_ba[:, num_heads_v : 2 * num_heads_v].contiguous())


# -- Gated DeltaNet ops (``gdn_backend`` / ``gdn_triton`` on the CPU: conv, gates, recurrence) --------------------


def _active(activation) -> bool:
    return activation is True or activation in ("silu", "swish")


def _conv_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1)  # [dim, 1, K] or [dim, K] -> [dim, K]


def _conv_out(window: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """Causal depthwise conv of u [dim, T] after window [dim, K-1] (``dspine.models.gdn.causal_conv``), + bias, SiLU."""
    y = causal_conv(window[None], u[None], _conv_weight(weight))[0]
    if bias is not None:
        y = y + bias[:, None].to(y.dtype)
    return F.silu(y) if _active(activation) else y


def _rolled(window: torch.Tensor, u: torch.Tensor, n: int) -> torch.Tensor:
    """The conv window after the first n of u [dim, T] (``dspine.models.gdn.roll_window``)."""
    return roll_window(window[None], u[None], torch.tensor([n]))[0]


def causal_conv1d_fn_cpu(mixed_qkv_transposed: torch.Tensor, conv_weights: torch.Tensor, bias, activation,
                         conv_states: torch.Tensor, has_initial_state: torch.Tensor, cache_indices: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens_cpu=None, **_unused) -> torch.Tensor:
    """Replaces ``sgl_kernel.mamba.causal_conv1d_fn_cpu`` (GDN prefill conv over packed sequences).

    x [dim, total] (sequences packed along tokens, bounds in query_start_loc); sequence i continues after
    conv_states[cache_indices[i]] [dim, K-1] when has_initial_state[i], else after zeros; returns the
    (SiLU-activated) conv output [dim, total] and leaves each slot holding its sequence's last K-1 inputs.
    Padding rows (negative slot) are skipped (output zeros).
    """
    x = mixed_qkv_transposed
    out = torch.zeros_like(x)
    bounds = query_start_loc.tolist()
    for i, slot in enumerate(cache_indices.tolist()):
        if slot < 0:
            continue
        s, e = int(bounds[i]), int(bounds[i + 1])
        window = conv_states[slot] if bool(has_initial_state[i]) else torch.zeros_like(conv_states[slot])
        u = x[:, s:e]
        out[:, s:e] = _conv_out(window, u, conv_weights, bias, activation).to(out.dtype)
        conv_states[slot] = _rolled(window, u, e - s)
    return out


def causal_conv1d_update_cpu(mixed_qkv: torch.Tensor, conv_states: torch.Tensor, conv_weights: torch.Tensor, bias,
                             activation, conv_state_indices=None, *, intermediate_conv_window=None,
                             intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                             retrieve_parent_token=None, **_unused) -> torch.Tensor:
    """Replaces ``sgl_kernel.mamba.causal_conv1d_update_cpu`` (GDN decode conv), plus the speculative-verify
    arguments of SGLang's Triton ``causal_conv1d_update`` (the CPU kernel has no verify mode).

    x [bs, dim] (one token) or [bs, dim, T] (a verify block); row i continues after
    conv_states[conv_state_indices[i]] and leaves it holding the last K-1 inputs after all T tokens. With
    ``intermediate_conv_window`` [rows, steps, dim, K-1], the window after each token t is also kept at
    [intermediate_state_indices[i], t], so the commit can roll the state back to the last accepted token
    (``fused_conv_window_scatter_with_mask``). Linear chains only (no EAGLE tree: DSPINE verifies a chain).
    """
    if retrieve_parent_token is not None or retrieve_next_token is not None or retrieve_next_sibling is not None:
        raise NotImplementedError("tree verify has no CPU conv (DSPINE verifies one linear chain)")
    squeeze = mixed_qkv.dim() == 2
    x = mixed_qkv[..., None] if squeeze else mixed_qkv
    out = torch.zeros_like(x)
    slots = range(x.shape[0]) if conv_state_indices is None else conv_state_indices.tolist()
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        window, u = conv_states[slot].clone(), x[i]
        out[i] = _conv_out(window, u, conv_weights, bias, activation).to(out.dtype)
        conv_states[slot] = _rolled(window, u, u.shape[-1])
        if intermediate_conv_window is not None:
            row = int(intermediate_state_indices[i]) if intermediate_state_indices is not None else i
            for t in range(u.shape[-1]):
                intermediate_conv_window[row, t] = _rolled(window, u, t + 1)
    return out[..., 0] if squeeze else out


def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replaces the CPU GDN gating kernel: a, b [T, HV] -> (g, beta) [1, T, HV] fp32, with
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (``dspine.models.gdn.gates``)."""
    g, beta = gates(a[None], b[None], A_log, dt_bias)
    return g, beta


def _state_in(state: torch.Tensor) -> torch.Tensor:
    """SGLang's [..., HV, V, K] state -> dspine.models.gdn's [..., HV, K, V] fp32."""
    return state.float().transpose(-1, -2)


def _state_out(S: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return S.transpose(-1, -2).to(like.dtype)


def _qk(q: torch.Tensor, k: torch.Tensor, l2norm: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [1, T, H, K] -> fp32 (L2-normalised with ``l2norm``, as ``dspine.models.gdn.prepare_qk``), q times scale
    (default K^-0.5)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if l2norm:
        qn, kn = prepare_qk(q, k)
        return qn * (scale / q.shape[-1] ** -0.5), kn
    return q.float() * scale, k.float()


def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                               head_first: bool = False, use_qk_l2norm_in_kernel: bool = True,
                               initial_state_indices: torch.Tensor | None = None, scale: float | None = None,
                               **_unused):
    """Replaces ``sgl_kernel.mamba.chunk_gated_delta_rule_cpu`` (GDN prefill recurrence, packed sequences).

    q, k [1, N, H, K], v [1, N, HV, V] (post-conv), g/beta [1, N, HV] (``fused_gdn_gating_cpu``); sequence i
    (bounds in cu_seqlens) starts from initial_state[initial_state_indices[i]] ([slots, HV, V, K], updated in
    place with its final state). SGLang's kernel is chunked; this runs ``dspine.models.gdn.delta_rule_scan`` token by
    token (the same math). Returns (outputs [1, N, HV, V] in q's dtype, final states [B, HV, V, K], None).
    """
    if head_first:
        raise NotImplementedError("head_first layout")
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    slots = range(len(bounds) - 1) if initial_state_indices is None else initial_state_indices.tolist()
    finals = []
    for i, slot in enumerate(slots):
        s, e = int(bounds[i]), int(bounds[i + 1])
        qn, kn = _qk(q[:, s:e], k[:, s:e], use_qk_l2norm_in_kernel, scale)
        S, o = delta_rule_scan(_state_in(initial_state[slot])[None], kn, v[:, s:e].float(), g[:, s:e].float(),
                               beta[:, s:e].float(), q=qn)
        initial_state[slot] = _state_out(S[0], initial_state)
        out[:, s:e] = o.to(out.dtype)
        finals.append(initial_state[slot].clone())
    final = torch.stack(finals) if finals else initial_state.new_zeros((0, *initial_state.shape[1:]))
    return out, final, None


def fused_sigmoid_gating_delta_rule_update_cpu(A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor,
                                               k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                               initial_state_source: torch.Tensor,
                                               initial_state_indices: torch.Tensor, cu_seqlens=None,
                                               use_qk_l2norm_in_kernel: bool = False, softplus_beta: float = 1.0,
                                               softplus_threshold: float = 20.0, scale=None, is_kda: bool = False,
                                               disable_state_update: bool = False, intermediate_states_buffer=None,
                                               intermediate_state_indices=None, cache_steps=None,
                                               retrieve_parent_token=None, stable_rows: bool = False) -> torch.Tensor:
    """Replaces the CPU kernel of the GDN decode step (gates + recurrence fused).

    q, k [1, N, H, K], v [1, N, HV, V], a, b [N, HV]; request i owns tokens cu_seqlens[i]:cu_seqlens[i+1] (one
    each in decode) and the state initial_state_source[initial_state_indices[i]] ([slots, HV, V, K]; zeros for a
    negative slot), updated in place unless ``disable_state_update``. Gates as ``fused_gdn_gating_cpu`` (with
    softplus beta/threshold). Returns the outputs [1, N, HV, V]. The recurrent speculative-verify mode
    (per-step snapshots) is not bridged: on the CPU path hybrid targets verify through ReplaySSM.
    """
    if is_kda or intermediate_states_buffer is not None or retrieve_parent_token is not None:
        raise NotImplementedError("recurrent GDN verify (per-step snapshots) / KDA have no CPU bridge; the CPU "
                                  "path verifies hybrid targets through ReplaySSM (--enable-linear-replayssm-spec)")
    N = q.shape[1]
    bounds = list(range(N + 1)) if cu_seqlens is None else cu_seqlens.tolist()
    g_all, beta_all = gates(a.reshape(1, N, -1), b.reshape(1, N, -1), A_log, dt_bias)
    if (softplus_beta, softplus_threshold) != (1.0, 20.0):
        g_all = -A_log.float().exp() * F.softplus(a.float().reshape(1, N, -1) + dt_bias.float(), softplus_beta,
                                                  softplus_threshold)
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    for i, slot in enumerate(initial_state_indices.tolist()[: len(bounds) - 1]):
        s, e = int(bounds[i]), int(bounds[i + 1])
        state = initial_state_source[slot] if slot >= 0 else torch.zeros_like(initial_state_source[0])
        qn, kn = _qk(q[:, s:e], k[:, s:e], use_qk_l2norm_in_kernel, scale)
        S, o = delta_rule_scan(_state_in(state)[None], kn, v[:, s:e].float(), g_all[:, s:e], beta_all[:, s:e],
                               q=qn)
        out[:, s:e] = o.to(out.dtype)
        if slot >= 0 and not disable_state_update:
            initial_state_source[slot] = _state_out(S[0], initial_state_source)
    return out


def fused_rmsnorm_gated_cpu(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Replaces the GDN output norm (``fla.layernorm_gated.RMSNorm``: a Triton kernel off the AMX path):
    ``weight * rmsnorm(x) * silu(z)`` per row (``dspine.models.gdn.gated_rmsnorm``); plain RMSNorm without z."""
    if z is None:
        xf = x.float()
        return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)
    return gated_rmsnorm(x, z, weight, eps)


# -- GDN ReplaySSM ring (``gdn_replayssm_spec_decode`` Triton kernels; ``spec_utils`` commit) ----------------------
#
# SGLang's GDN ReplaySSM (--enable-linear-replayssm-spec) keeps, per request slot r, a fp32 checkpoint (the
# ``temporal`` state, keyed by the mamba slot) and a circular ring of the last committed steps' records
# (delta [HV, V], normalised key [H, K], log-decay g [HV]) of length L (power of two), addressed from
# ``cache_base[r]``, ``write_pos[r]`` records long. The committed state is the checkpoint advanced over the ring
# (``dspine.models.gdn.decay_add`` per record). Verify reconstructs it, runs the block, and writes the block's records
# after the committed ones; the commit only moves ``write_pos`` by the accepted count (a rejected draft's record
# is simply overwritten later) and folds the ring into the checkpoint when the next block might not fit.


def _ring_positions(base: int, start: int, n: int, L: int) -> torch.Tensor:
    return (base + start + torch.arange(n)) & (L - 1)


def _per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[H, ...] key-head records -> [HV, ...]: key head h serves value heads h*rep .. h*rep+rep-1."""
    return x.repeat_interleave(hv // x.shape[0], dim=0) if x.shape[0] != hv else x


def _ring_records(d_cache, k_cache, g_cache, d_res, k_res, r: int, phys: torch.Tensor):
    """(keys [HV, n, K], deltas [HV, n, V], g [HV, n]) fp32 at ring positions phys of slot r (hi + lo parts)."""
    d = d_cache[r][:, phys].float()
    k = k_cache[r][:, phys].float()
    if d_res is not None and k_res is not None:
        d = d + d_res[r][:, phys].float()
        k = k + k_res[r][:, phys].float()
    return _per_value_head(k, d.shape[0]), d, g_cache[r][:, phys].float()


def _fold(S: torch.Tensor, keys: torch.Tensor, deltas: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """S [HV, K, V] advanced over records keys [HV, n, K], deltas [HV, n, V], g [HV, n], oldest first."""
    for t in range(keys.shape[1]):
        S = decay_add(S, keys[:, t], deltas[:, t], g[:, t])
    return S


def _store(cache: torch.Tensor, res, r: int, p: int, value: torch.Tensor) -> None:
    """Write a record in the ring's dtype, its rounding error into the residual ring when there is one."""
    hi = value.to(cache.dtype)
    cache[r][:, p] = hi
    if res is not None:
        res[r][:, p] = (value - hi.float()).to(res.dtype)


def gdn_replayssm_spec_decode(q, k, v, a, b, A_log, dt_bias, checkpoint_state, d_cache, k_cache, g_cache,
                              rawv_cache, rawk_cache, beta_cache, out, query_start_loc, ssm_state_indices,
                              replay_indices, write_pos, cache_base, is_flush, max_cache_len: int,
                              max_spec_len: int, scale: float | None = None, use_qk_l2norm_in_kernel: bool = True,
                              null_block_id: int = 0, launch_mode: str = "both", **_tuning) -> torch.Tensor:
    """Replaces the Triton ReplaySSM GDN verify (``launch_mode="verify"``, the one SGLang's GDN backend uses).

    q, k [N, H, K], v [N, HV, V], a, b [N, HV] (post-conv, packed by query_start_loc); per request i: mamba slot
    ``ssm_state_indices[i]`` (checkpoint [HV, V, K] in checkpoint_state, read only) and ring slot
    ``replay_indices[i]``. Reconstructs the committed state from the checkpoint and the ring's write_pos records,
    runs the block through ``dspine.models.gdn.delta_rule_update`` writing outputs into ``out`` [N, HV, V], and stores
    each block token's (delta, key, g) record at ring position write_pos + t (only while it fits in L).
    Requests on a padding slot (<= null_block_id) get zero output; ring slots flagged for a flush are left to the
    flush launch, as in the kernel. The kernel reconstructs outputs with a chunked (I + A)^-1 transform; this
    runs the recurrence (the same math).
    """
    if launch_mode != "verify":
        raise NotImplementedError(f"ReplaySSM launch_mode {launch_mode!r} (the CPU bridge runs 'verify' only)")
    if beta_cache is not None:
        raise NotImplementedError("ReplaySSM exact-raw rings (fold-every-commit) have no CPU bridge")
    L = int(max_cache_len)
    HV = v.shape[1]
    g_all, beta_all = gates(a.reshape(1, -1, HV), b.reshape(1, -1, HV), A_log, dt_bias)
    bounds = query_start_loc.tolist()
    for i, (slot, r) in enumerate(zip(ssm_state_indices.tolist()[: len(bounds) - 1],
                                      replay_indices.tolist(), strict=False)):
        s, e = int(bounds[i]), int(bounds[i + 1])
        if slot <= null_block_id:
            out[s:e] = 0
            continue
        if int(is_flush[r]) != 0:
            continue
        wp, base = int(write_pos[r]), int(cache_base[r])
        S = _state_in(checkpoint_state[slot])
        keys, deltas, g_hist = _ring_records(d_cache, k_cache, g_cache, rawv_cache, rawk_cache, r,
                                             _ring_positions(base, 0, wp, L))
        S = _fold(S, keys, deltas, g_hist)[None]  # [1, HV, K, V]: the committed state
        qn, kn = _qk(q[None, s:e], k[None, s:e], use_qk_l2norm_in_kernel, scale)  # [1, T, H, K]
        qv, kv = _per_value_head(qn[0].transpose(0, 1), HV), _per_value_head(kn[0].transpose(0, 1), HV)
        for t in range(e - s):
            g_t, beta_t = g_all[:, s + t], beta_all[:, s + t]
            S, delta = delta_rule_update(S, kv[None, :, t], v[None, s + t].float(), g_t, beta_t)
            out[s + t] = delta_rule_read(S, qv[None, :, t])[0].to(out.dtype)
            if wp + t < L:
                p = int(_ring_positions(base, wp + t, 1, L))
                _store(d_cache, rawv_cache, r, p, delta[0])
                _store(k_cache, rawk_cache, r, p, kn[0, t])
                g_cache[r][:, p] = g_t[0]
    return out


def commit_gdn_replayssm_spec(write_pos, cache_base, is_flush, num_accepted, replay_indices, max_cache_len: int,
                              max_spec_len: int, fold_every_commit: bool = False, cache_buf_len: int | None = None,
                              null_block_id: int = 0) -> None:
    """Replaces the Triton cursor advance after a ReplaySSM verify (``commit_gdn_replayssm_spec``).

    Per request (ring slot ``replay_indices[i]`` > null_block_id): the ring now holds ``num_accepted[i]`` more
    committed records (bonus token included); a slot already flagged for a flush starts over at its new base.
    The slot is flagged for a flush when the next block might not fit: write_pos + 2 * max_spec_len > L (any
    record at all with ``fold_every_commit``).
    """
    buf = int(cache_buf_len or max_cache_len)
    for i, r in enumerate(replay_indices.tolist()):
        if r <= null_block_id:
            continue
        wp, base, flush, n = int(write_pos[r]), int(cache_base[r]), int(is_flush[r]) != 0, int(num_accepted[i])
        new_base = (base + wp) & (buf - 1) if (flush and n > 0) else base
        new_wp = n if flush else wp + n
        write_pos[r], cache_base[r] = new_wp, new_base
        is_flush[r] = int(new_wp > 0) if fold_every_commit else int(new_wp + 2 * int(max_spec_len) > int(max_cache_len))


def commit_gdn_replayssm_circular(*, checkpoint_state, d_cache, k_cache, g_cache, d_residual_cache,
                                  k_residual_cache, state_batch_indices, replay_indices, write_pos, cache_base,
                                  is_flush, accept_lens, mamba_track_indices=None, mamba_steps_to_track=None,
                                  null_block_id: int = -1) -> None:
    """Replaces the Triton ReplaySSM fold (``commit_gdn_replayssm_circular``), all GDN layers at once.

    Tensors carry a leading layer dim (checkpoint [layers, slots, HV, V, K], rings [layers, rslots, ...]);
    ``write_pos`` already includes this commit. For a request whose ring slot is flagged for a flush, every
    layer's checkpoint is advanced over its write_pos records and the ring restarts empty after them. With
    prefix-cache tracking, the state after ``write_pos - accept_lens + step + 1`` records (the interval-crossing
    step of this commit) is written to the tracking slot ``mamba_track_indices[i]`` (from the checkpoint
    before any fold), leaving the active checkpoint alone.
    """
    L = d_cache.shape[-2]
    track = mamba_track_indices is not None and mamba_steps_to_track is not None
    folded = []
    for i, (slot, r) in enumerate(zip(state_batch_indices.tolist(), replay_indices.tolist(), strict=False)):
        if slot <= null_block_id:
            continue
        n_hist, fold = int(write_pos[r]), int(is_flush[r]) != 0
        track_slot = int(mamba_track_indices[i]) if track else null_block_id
        step = int(mamba_steps_to_track[i]) if track else -1
        has_track = track_slot > null_block_id and step >= 0
        if not (fold or has_track):
            continue
        track_len = n_hist - int(accept_lens[i]) + step + 1
        phys = _ring_positions(int(cache_base[r]), 0, L, L)
        for layer in range(checkpoint_state.shape[0]):
            old = _state_in(checkpoint_state[layer, slot])
            keys, deltas, g = _ring_records(d_cache[layer], k_cache[layer], g_cache[layer],
                                            None if d_residual_cache is None else d_residual_cache[layer],
                                            None if k_residual_cache is None else k_residual_cache[layer], r, phys)
            if has_track:
                checkpoint_state[layer, track_slot] = _state_out(
                    _fold(old, keys[:, :track_len], deltas[:, :track_len], g[:, :track_len]), checkpoint_state)
            if fold:
                checkpoint_state[layer, slot] = _state_out(
                    _fold(old, keys[:, :n_hist], deltas[:, :n_hist], g[:, :n_hist]), checkpoint_state)
        if fold:
            folded.append((r, n_hist))
    for r, n_hist in folded:
        cache_base[r] = (int(cache_base[r]) + n_hist) & (L - 1)
        write_pos[r] = 0
        is_flush[r] = 0


def fused_conv_window_scatter_with_mask(dst: torch.Tensor, src: torch.Tensor, dst_indices_raw: torch.Tensor,
                                        step_indices_raw: torch.Tensor, src_indices_raw=None) -> None:
    """Replaces the Triton conv-state rollback after a verify (``fused_conv_window_scatter_with_mask``).

    dst conv states [layers, slots, dim, K-1]; src per-step windows [layers, rows, steps, dim, K-1] (written by
    ``causal_conv1d_update_cpu`` during verify). For each request i with step >= 0 (and indices in range):
    ``dst[:, dst_indices_raw[i]] = src[:, src_row_i, step_indices_raw[i]]``, src_row_i = ``src_indices_raw[i]``
    (default i).
    """
    steps = step_indices_raw.tolist()
    rows = list(range(len(steps))) if src_indices_raw is None else src_indices_raw.tolist()
    for dst_i, step, src_i in zip(dst_indices_raw.tolist(), steps, rows, strict=True):
        if step < 0 or not (0 <= dst_i < dst.shape[1]) or src_i >= src.shape[1] or step >= src.shape[2]:
            continue
        dst[:, dst_i] = src[:, src_i, step]


# -- registration ---------------------------------------------------------------------------------------------------

# The ops SGLang reaches through ``torch.ops.sgl_kernel.<name>`` on the CPU path, with our schemas.
TORCH_OPS = {
    "fused_sigmoid_mul_cpu": ("(Tensor(a!) x, Tensor gate) -> ()", fused_sigmoid_mul_cpu),
    "fused_qk_gemma_rmsnorm_cpu": (
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
        fused_qk_gemma_rmsnorm_cpu),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads) "
        "-> (Tensor, Tensor, Tensor)", fused_qk_gemma_rmsnorm_with_gate_cpu),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)", fused_qkvzba_split_reshape_cat_contiguous_cpu),
    "fused_gdn_gating_cpu": ("(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
                             fused_gdn_gating_cpu),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor? cu_seqlens=None, "
        "bool use_qk_l2norm_in_kernel=False, float softplus_beta=1.0, float softplus_threshold=20.0, "
        "float? scale=None, bool is_kda=False, bool disable_state_update=False, "
        "Tensor? intermediate_states_buffer=None, Tensor? intermediate_state_indices=None, int? cache_steps=None, "
        "Tensor? retrieve_parent_token=None, bool stable_rows=False) -> Tensor",
        fused_sigmoid_gating_delta_rule_update_cpu),
    "fused_rmsnorm_gated_cpu": ("(Tensor x, Tensor weight, Tensor? z, float eps) -> Tensor", fused_rmsnorm_gated_cpu),
}
_library = None


def register_torch_ops() -> None:
    """Define ``torch.ops.sgl_kernel.<name>`` for every op in ``TORCH_OPS`` (CPU implementations; idempotent).

    Only the stand-in calls this, i.e. only when the real ``sgl_kernel`` (which registers the real ops) cannot
    import.
    """
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, (schema, fn) in TORCH_OPS.items():
        lib.define(name + schema)
        lib.impl(name, fn, "CPU")
    _library = lib


# ``sgl_kernel.mamba`` in the stand-in
MAMBA_OPS = {f.__name__: f for f in (causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu)}


OPS = {f.__name__: f for f in (assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu,
                                assign_draft_cache_locs_contiguous_cpu, copy_all_layer_kv_cache_cpu)}
