"""``DSpineDraftModel``: the DSpine draft inside SGLang 0.5.23, on top of its DFlash draft model.

What DFlash already gives (``sglang.srt.models.dflash.DFlashDraftModel``): five Qwen3 decoder layers over
SGLang's paged draft KV, context rows materialised from the target's tapped hidden states
(``project_target_hidden`` = ``hidden_norm(fc(taps))``, then per layer K/V only), the block forward in
TARGET_VERIFY mode, and **causal in-block attention** when the config says ``"is_causal": true``
(``_get_dflash_attention_type`` -> ``AttentionType.DECODER``; DFlash's own checkpoints are bidirectional).

What DSpine adds here (math in ``dspine.sglang.draft_math``, checked against ``dspine.draft.model`` on CPU):

* adjacent injection after every layer (``Injection``, the reference module and checkpoint names);
* the packed output ``[normed_post | last_pre | last_feat]`` so the worker can refine;
* a candidate selector (the DFlash2 seam the worker already drives, greedy and sampled with q):
  ``compute_candidates`` = top-k of the backbone logits over the *target* LM head, ``build_lattice`` = the
  last-write-refined transition cache, ``sample_path`` = the greedy / inverse-CDF walk.

The embedding and LM head are the target's (the worker passes ``input_embeds`` from the target embedding and
sets ``self.lm_head`` to the target head before use). The optional confidence head is not loaded: SGLang
phase 1 verifies the full block (no dynamic stopping).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.dflash import DFlashDraftModel, candidate_topk

from dspine.draft.config import parse_draft_config
from dspine.draft.model import DSpineDraft, Injection
from dspine.models.checkpoint import ModelLoadError

from .. import draft_math as dm

logger = logging.getLogger(__name__)

_STACKED = (  # (fused param, checkpoint name, shard id): as DFlash/Qwen3 in SGLang
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def _config_dict(config) -> dict:
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    # transformers may fold rope keys into rope_parameters; parse_draft_config reads both spellings
    return cfg


class DSpineSelector:
    """The DFlash2 ``CandidateSelector`` interface over DSpine's transition cache (not an nn.Module: it
    owns no weights; it reads the draft's injection, norm and codes and the target head)."""

    def __init__(self, model: DSpineDraftModel, top_k: int):
        self._model = model
        self.top_k = int(top_k)

    def build_lattice(self, *, candidate_ids, unary_logits, hidden_states, anchor_token_ids):
        m = self._model
        _, pre, feat = dm.unpack_hidden(hidden_states, m.hidden_size)
        return dm.transition_scores(m.injection, m.norm_any, m.num_layers, pre, feat, candidate_ids,
                                    anchor_token_ids, m.transfer_codes, m.head_weight(),
                                    unary=unary_logits.view(candidate_ids.shape))

    def sample_path(self, *, candidate_ids, scores, uniforms, temperatures, greedy_mask):
        return dm.walk(candidate_ids, scores, uniforms, temperatures, greedy_mask)


class DSpineDraftModel(DFlashDraftModel):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        cfg = _config_dict(config)
        try:
            spec = parse_draft_config(cfg, where="draft config.json")
        except ModelLoadError as e:
            raise ValueError(f"DSPINE draft: {e}") from e
        if quant_config is not None:
            raise ValueError("DSPINE draft: quantized drafts are not supported")
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.spec = spec
        self.hidden_size = spec.hidden_size
        self.num_layers = spec.num_layers
        self.transfer_rank = spec.transfer_rank
        self.injection_offsets = list(spec.injection_offsets)
        self.injection = Injection(spec.hidden_size, spec.transfer_rank, spec.message_size, spec.num_layers)
        self.register_buffer("transfer_codes", torch.zeros(spec.vocab_size, spec.transfer_rank))
        self.register_buffer("transfer_ready", torch.tensor(False))
        # A draft vocabulary (dspine.draft.model.DSpineDraft.head): candidates come from these target ids only.
        if spec.draft_vocab_size is not None:
            self.register_buffer("draft_vocab", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._head_rows = None
        self._pad_ids = None  # target ids outside the draft vocabulary (candidate padding when V' < top_k)
        self.candidate_selector = DSpineSelector(self, spec.top_k)
        self.lm_head = None  # the target's; set by the worker
        # The target's token embedding (ids -> rows, as the worker embeds the block); set by the worker. SGLang's
        # model runner casts every ``input_embeds`` to bfloat16 before a forward (model_runner.py, extend kwargs),
        # which would feed an fp32/fp16 draft bf16-rounded rows (a dtype error in eager mode, silently different
        # proposals otherwise), so the draft re-embeds its block's ids itself.
        self.target_embed = None
        self._expected = self._expected_names(cfg)

    @staticmethod
    def _expected_names(cfg: dict) -> set[str]:
        with torch.device("meta"):
            ref = DSpineDraft(cfg, confidence_head=False, where="draft config.json")
        return {n for n in ref.state_dict() if not n.startswith("rotary.")}

    # -- helpers the selector and worker use -------------------------------------------------------------------
    def head_weight(self) -> torch.Tensor:
        if self.lm_head is None or getattr(self.lm_head, "weight", None) is None:
            raise RuntimeError("DSPINE draft: the target lm_head (dense weight) was not attached")
        return self.lm_head.weight

    def norm_any(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm on any leading shape (SGLang's fused kernels take 2-D input)."""
        shape = x.shape
        return self.norm(x.reshape(-1, shape[-1]).contiguous()).view(shape)

    @property
    def packed_width(self) -> int:
        return 2 * self.hidden_size + self.transfer_rank

    def compute_candidates(self, hidden: torch.Tensor):
        """Top-k backbone candidates over the target head: packed hidden [N, 2H+r] -> ids, logits [N, k]."""
        normed = hidden[:, : self.hidden_size].contiguous()
        if self.draft_vocab is None:
            ids, vals, _ = candidate_topk(normed, self.lm_head, self.candidate_selector.top_k)
            return ids, vals.float()
        w = self.head_weight()
        if self._head_rows is None or self._head_rows[0] != w.data_ptr():  # a host attribute: no device read
            self.prepare_vocab()
        return dm.vocab_candidates(normed, self._head_rows[1], self.draft_vocab, self.candidate_selector.top_k,
                                   self._pad_ids)

    def prepare_vocab(self) -> None:
        """The draft-vocabulary caches (the head's rows, the padding ids), built when the worker attaches the target
        head, before SGLang's warm-up and any graph capture: the padding ids need a host read (``nonzero``), which
        must never happen inside a round. The rows are rebuilt (no host read) if the head's weight is replaced."""
        if self.draft_vocab is None:
            return
        w = self.head_weight()
        vocab = self.draft_vocab.to(w.device)
        self._head_rows = (w.data_ptr(), w.index_select(0, vocab))
        if self._pad_ids is None:
            self._pad_ids = dm.pad_candidate_ids(vocab, w.shape[0], self.candidate_selector.top_k)

    # -- forward -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None) -> LogitsProcessorOutput:
        if input_embeds is None:
            raise ValueError("DSpineDraftModel requires input_embeds (the worker embeds with the target)")
        N = input_embeds.shape[0]
        if N == 0:
            return LogitsProcessorOutput(next_token_logits=None,
                                         hidden_states=input_embeds.new_empty((0, self.packed_width)))
        if self.target_embed is not None:
            input_embeds = self.target_embed(input_ids)
        input_embeds = input_embeds.to(self.norm.weight.dtype)
        B = int(self.block_size)
        if N % B:
            raise RuntimeError(f"DSPINE draft forward got {N} tokens, not a multiple of the block width {B}")
        anchor = input_ids.view(N // B, B)[:, 0]
        anchor_pred = dm.anchor_predecessor(self.injection, self.transfer_codes, anchor)

        def layer_call(i, hidden, residual):
            return self.layers[i](positions, hidden, forward_batch, residual)

        packed = dm.block_forward(layer_call, self.num_layers, input_embeds, B, self.injection, anchor_pred,
                                  self.injection_offsets, self.norm_any)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=packed)

    # -- weights -----------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Strict loader for the dspine checkpoint format (docs/design.md, "The DSpine draft"): optional
        ``model.`` prefix, ``embed_tokens.*``/``lm_head.*``/``confidence_head.*`` ignored, anything else unknown
        or missing fails."""
        params = dict(self.named_parameters())
        buffers = {"transfer_codes": self.transfer_codes, "transfer_ready": self.transfer_ready}
        if self.draft_vocab is not None:
            buffers["draft_vocab"] = self.draft_vocab
        seen: set[str] = set()
        unknown: list[str] = []
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if name.startswith(("embed_tokens.", "lm_head.", "confidence_head.")):
                continue
            if name in buffers:
                buf = buffers[name]
                if tuple(tensor.shape) != tuple(buf.shape):
                    raise ValueError(
                        f"DSPINE draft: {raw} has shape {tuple(tensor.shape)}, expected {tuple(buf.shape)}")
                buf.copy_(tensor.to(device=buf.device, dtype=buf.dtype))
                seen.add(name)
                continue
            for fused, part, shard in _STACKED:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    if target not in params:
                        break
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    seen.add(name)
                    break
            else:
                if name not in params:
                    unknown.append(raw)
                    continue
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape) and not hasattr(param, "weight_loader"):
                    raise ValueError(
                        f"DSPINE draft: {raw} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                seen.add(name)
                continue
            if name not in seen:
                unknown.append(raw)
        missing = sorted(self._expected - seen)
        if unknown or missing:
            raise ValueError(f"DSPINE draft checkpoint does not match its config: missing {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}, unexpected {unknown[:8]}")
        if not bool(self.transfer_ready):
            raise ValueError("DSPINE draft: transfer_ready is false in the checkpoint (codes never computed)")


EntryClass = [DSpineDraftModel]
