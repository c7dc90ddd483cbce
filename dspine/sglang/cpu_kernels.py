"""Torch versions of the few ``sgl_kernel`` CPU ops SGLang 0.5.23 calls on a CPU (a test/dev path).

The kernel package on the package index is the CUDA build; on a machine without a GPU driver its import fails
(``libcuda.so.1``), while SGLang's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports these ops from it at module
import time. ``dspine.sglang.stand_in`` exposes them under the name ``sgl_kernel`` only when the real package
cannot import (see ``dspine.sglang.cpu``). Each one does what its name says on the request-to-token table /
KV pool with plain tensor indexing; speed is irrelevant on the tiny models the CPU tests run.
"""

from __future__ import annotations

import ctypes

import torch


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


OPS = {f.__name__: f for f in (assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu,
                                assign_draft_cache_locs_contiguous_cpu, copy_all_layer_kv_cache_cpu)}
