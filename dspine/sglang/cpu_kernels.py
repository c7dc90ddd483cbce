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


OPS = {f.__name__: f for f in (assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu,
                                assign_draft_cache_locs_contiguous_cpu, copy_all_layer_kv_cache_cpu)}
