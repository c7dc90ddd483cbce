"""The CPU reference engine: ``dspine.decoding.decode.decode_stream`` (speculative with a DSpine draft, plain AR
without).

``run`` streams: up to ``batch_size`` requests decode together, a finished request is yielded the round it
finishes (so the sink commits it at once) and the next request is pulled from the iterator only when a slot is
free, so admission stops as soon as the request iterator does. A request the decoder rejects (e.g. an over-long
prompt) comes back as that row's error, never its neighbours'. Stop strings are applied after generation (the
decoder takes token ids). Verification is cost-aware by default (``verify=cost``; ``verify=fixed`` verifies
whole blocks): the cost model is calibrated once per model, machine and thread count and cached on disk.

Proposals (``proposers``): ``auto`` (default) lets every row choose per round between a plain step, the DSpine
draft's block and a suffix match over text already seen (its prompt and output, its ``--num-samples`` siblings,
finished rows: ``dspine.decoding.suffix``); ``dspine`` the draft only; ``suffix`` suffix matches only. Without a
draft (a model the embedded draft does not fit) ``auto`` uses suffix matches alone; ``--draft none`` is plain
decoding with no speculation of any kind.

Prompt prefixes (``prefix_cache_mb``, default 512): a radix tree over prompt tokens keeps what prefill computed,
so rows behind one system prompt or template and the ``--num-samples`` siblings of a row prefill only what is new
(``dspine.decoding.prefix``); each row reports ``cached_prompt_tokens``. Outputs are identical with it off.

Decisions (``explain()``, ``engines.explain``): per source, the rounds, tokens proposed and accepted summed from
the results, and why a source cannot run with these settings; the cost model's own reasons under ``auto`` come
from the decode loop through the ``decisions`` dict it is handed. ``prepare(max_in_flight)`` calibrates (and
caches) the cost model a run with that window would measure at its start (``dspine-batch prepare``).

Chunked prefill (``prefill_chunk``, default ``DEFAULT_PREFILL_CHUNK`` tokens; 0 = whole prompts): newcomers' prompts
are computed at most that many tokens per forward, and the rows in flight run one round between two forwards, so
a long prompt does not stall them and a prefill's activations stay bounded. Dense targets on the CPU kernels
only, where a row ends bit-identical however its prompt was cut (``dspine.decoding.decode.chunking_exact``);
elsewhere (hybrids, torch's GEMMs) prompts go whole. Not part of the identity: it cannot change an output.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dspine.models.tokenizer import HFTokenizer
from dspine_batch.engines.base import FEATURES, Request, Result
from dspine_batch.engines.explain import SOURCES, SourceTally
from dspine_batch.engines.models import model_identity, open_tokenizer, resolve_draft, resolve_model
from dspine_batch.engines.stop_strings import cut_at_stop
from dspine_batch.errors import FatalError, UsageError

ARGS = {"batch_size": int, "block_size": int, "threads": int, "dynamic_threshold": float, "verify": str,
        "accept_prior": float,
        "dtype": str, "quant": str, "proposers": str, "suffix_cap": int, "suffix_max": int,
        "prefix_cache_mb": int, "prefill_chunk": int}
PROPOSERS = ("auto", "dspine", "suffix")
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill forward (see the module docstring)


def _open_draft(path: Path) -> Any:
    """The draft as the engine runs it: packed for the CPU kernels, the packed form read from the per-machine cache
    (keyed on the checkpoint's files) where an earlier load left it. Called by the engine's ``LazyDraft`` when a
    stream first needs the draft (possibly mid-job), so the pages its conversion freed are given back at once."""
    from dspine import load_draft
    from dspine.cpu.memory import trim
    from dspine.models.registry import checkpoint_key

    draft = load_draft(path).use_kernels(checkpoint_key(path))
    trim(collect=False)  # the fp32 copy of its bf16 checkpoint, converted and repacked, freed; no gc pass mid-job
    return draft


class ReferenceEngine:
    name = "reference"
    # request features beyond plain sampling (base.FEATURES): all of them, through the decoding loop's processing
    # seam (``dspine.decoding.processors``: penalties, logit bias, min_tokens, logprobs) and xgrammar grammars
    # (``dspine.decoding.grammar``), lossless under every proposer
    features: frozenset[str] = FEATURES

    def __init__(self, target: Any, draft: Any, tokenizer: HFTokenizer, model_path: Path, draft_path: Path | None,
                 batch_size: int, block_size: int | None, dynamic_threshold: float | None = None,
                 verify: str = "cost", precision: dict[str, str] | None = None,
                 accept_prior: float | None = None, proposers: str | None = "dspine",
                 suffix_cap: int | None = None, suffix_max: int | None = None, prefix_cache_mb: int | None = None,
                 prefill_chunk: int | None = None):
        from dspine.decoding.prefix import DEFAULT_CAP_MB, PrefixCache
        from dspine.decoding.suffix import DEFAULT_CAP_TOKENS, MAX_PROPOSAL

        self.target, self.draft, self.tok = target, draft, tokenizer
        # what proposes: None (plain decoding), "dspine", "suffix" or "auto" (see the module docstring)
        self.proposers = proposers if draft is not None or proposers != "dspine" else None
        self.suffix_cap = DEFAULT_CAP_TOKENS if suffix_cap is None else suffix_cap
        self.suffix_max = MAX_PROPOSAL if suffix_max is None else suffix_max
        self.model_path = model_path
        self.batch_size = batch_size
        self.block_size = block_size or (int(draft.block_size) if draft is not None else None)
        # Confidence-based early stop of each proposal (lossless; needs a fitted confidence head, else ignored).
        self.dynamic_threshold = dynamic_threshold if draft is not None and draft.confidence_enabled else None
        self._identity = {"engine": "reference", "model": model_identity(model_path),
                          "draft": model_identity(draft_path) if draft_path else None,
                          "block_size": self.block_size, "dtype": "float32"}
        # dtype/quant change the target's outputs, so they are part of the run's identity ("quant" only when set,
        # so fingerprints of existing fp32 runs stay the same)
        precision = precision or {}
        self._identity["dtype"] = precision.get("dtype", "float32")
        kernel = getattr(target, "kernel", "torch")
        if kernel != "torch":  # our linears round differently from torch's (fingerprints of torch runs unchanged)
            self._identity["kernel"] = kernel
        if precision.get("quant", "none") != "none":
            self._identity["quant"] = precision["quant"]
        if self.dynamic_threshold is not None:
            self._identity["dynamic_threshold"] = self.dynamic_threshold
        self.accept_prior = accept_prior if draft is not None else None
        if self.accept_prior is not None:  # changes which rounds draft, so sampled tokens: part of the identity
            self._identity["accept_prior"] = self.accept_prior
        self.verify = verify
        if self.proposers not in (None, "dspine"):  # sampled rows then never use the draft: other tokens
            self._identity["proposers"] = self.proposers
        if draft is not None:
            self._identity["verify"] = verify
        self._costs: dict[tuple[int, str | None], Any] = {}
        self._grammars: Any = None  # dspine.decoding.grammar.Grammars, made on the first structured request
        # Prompt prefixes kept across rows (and runs of this engine). Only where a row's prefill is batch and
        # split invariant (our CPU kernels): there a hit never changes an output, so it is not part of the
        # identity; torch's GEMMs (bf16, quantized, no compiler) round differently for different token counts.
        mb = DEFAULT_CAP_MB if prefix_cache_mb is None else prefix_cache_mb
        gaps = getattr(target, "invariance_gaps", ())  # a family's pieces that are not invariant (longrope, ...)
        self.prefix = PrefixCache(mb << 20) if mb > 0 and str(kernel).startswith("dspine-") and not gaps else None
        if gaps and str(kernel).startswith("dspine-"):  # on our kernels these would be on: say why they are not
            for gap in gaps:
                print(f"dspine-batch: {getattr(target, 'family', 'this model')}: prefix cache and chunked prefill "
                      f"off: {gap}", file=sys.stderr, flush=True)
        # Chunked prefill: exact on the same kernels (``decode.chunking_exact``), whole prompts elsewhere, so the
        # chunk size never changes an output and is not part of the identity either.
        from dspine.decoding.decode import chunking_exact

        chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        self.prefill_chunk = chunk if chunking_exact(target) else 0
        # explain(): counts from the results yielded; ``decisions`` is handed to the decode loop, which may put a
        # source's reasons there ({source: {"why": ..., ...}}: see dspine_batch.engines.explain)
        self.tally = SourceTally()
        self.decisions: dict[str, dict[str, Any]] = {}

    @classmethod
    def load(cls, model: str, draft: str, args: dict[str, str]) -> ReferenceEngine:
        opts: dict[str, Any] = {}
        for k, v in args.items():
            if k not in ARGS:
                raise UsageError(f"--engine-arg {k}: unknown for the reference engine ({', '.join(ARGS)})")
            try:
                opts[k] = ARGS[k](v)
            except ValueError as e:
                kind = "an integer" if ARGS[k] is int else "a number"
                raise UsageError(f"--engine-arg {k}={v}: expected {kind}") from e
        proposers = opts.get("proposers", "auto")
        if proposers not in PROPOSERS:
            raise UsageError(f"--engine-arg proposers={proposers}: expected one of {', '.join(PROPOSERS)}")
        verify = opts.get("verify", "cost")
        if verify not in ("cost", "fixed"):
            raise UsageError(f"--engine-arg verify={verify}: expected cost or fixed")
        if verify == "fixed":  # a fixed block is the draft's: suffix proposals are chosen by the cost model
            if proposers == "suffix":
                raise UsageError("--engine-arg proposers=suffix needs verify=cost (suffix proposals are chosen by "
                                 "the cost model)")
            proposers = "dspine"
        if not 1 <= opts.get("suffix_max", 16) <= 64:
            raise UsageError(f"--engine-arg suffix_max={opts['suffix_max']}: expected 1..64")
        if opts.get("suffix_cap", 1) < 1:
            raise UsageError(f"--engine-arg suffix_cap={opts['suffix_cap']}: expected a positive token count")
        if opts.get("prefill_chunk", 0) < 0:
            raise UsageError(f"--engine-arg prefill_chunk={opts['prefill_chunk']}: expected a token count >= 0 "
                             "(0 = whole prompts)")
        if opts.get("prefix_cache_mb", 0) < 0:
            raise UsageError(f"--engine-arg prefix_cache_mb={opts['prefix_cache_mb']}: expected MB >= 0 (0 = off)")
        if draft in ("none", ""):
            proposers = None  # --draft none: plain decoding, no speculation of any kind
        from dspine import load_target
        from dspine.cpu.precision import resolve
        from dspine.cpu.threads import configure_torch
        from dspine.draft.io import read_decode_defaults
        from dspine.draft.lazy import LazyDraft

        configure_torch(opts.get("threads"))  # the cores this process may use (affinity, cgroup, Slurm)
        quant = opts.get("quant", "none")
        dtype = opts.get("dtype", "auto")
        try:
            resolve(dtype, quant)  # names checked before anything loads
        except ValueError as e:
            raise UsageError(f"--engine-arg {e}") from e
        model_path = resolve_model(model)
        draft_path = resolve_draft(draft, model)
        if dtype == "auto":  # bf16 where our bf16 family runs this target (registry.auto_dtype), else fp32
            from dspine.models.registry import auto_dtype

            try:
                dtype = auto_dtype(model_path, quant)
            except (ValueError, OSError) as e:
                raise UsageError(f"cannot load the model: {e}") from e
        precision = resolve(dtype, quant)
        try:
            target = load_target(model_path, dtype=precision.torch_dtype, device="cpu", quant=precision.quant)
            # its config and header now (a broken draft fails here, in one line), its weights on first use: a
            # stream that retires it before its first prefill never reads them (``dspine.draft.lazy``)
            drafter = LazyDraft(draft_path, _open_draft) if draft_path else None
            defaults = read_decode_defaults(draft_path) if draft_path else {}
        except (ValueError, OSError) as e:  # ModelLoadError is a ValueError
            raise UsageError(f"cannot load the model: {e}") from e
        tok = open_tokenizer(model_path)
        from dspine.cpu.memory import trim

        trim()  # what loading converted and repacked given back
        if drafter is None and proposers == "auto":
            proposers = "suffix"  # no draft for this model: suffix matches alone
        # The draft's measured decode settings (decode.json) apply unless --engine-arg sets them.
        block_size = opts.get("block_size", defaults.get("block_size"))
        if drafter is not None and block_size is not None and not 2 <= block_size <= drafter.block_size:
            raise UsageError(f"block_size {block_size}: the draft supports 2..{drafter.block_size}")
        return cls(target, drafter, tok, model_path, draft_path, opts.get("batch_size", 8), block_size,
                   opts.get("dynamic_threshold", defaults.get("dynamic_threshold")), verify, precision.describe(),
                   opts.get("accept_prior", defaults.get("accept_prior")), proposers, opts.get("suffix_cap"),
                   opts.get("suffix_max"), opts.get("prefix_cache_mb"), opts.get("prefill_chunk"))

    def identity(self) -> dict[str, Any]:
        return self._identity

    @property
    def first_token_at(self) -> float | None:
        """``time.monotonic()`` when this engine's first rows got their first tokens (None before any did)."""
        return self.decisions.get("_first_token")

    @property
    def max_context(self) -> int | None:
        """Prompt tokens a request may have (as plain decoding: verify slots may run past the context, see
        ``dspine.decoding.decode._extra``, so speculation takes no context away)."""
        return int(self.target.max_position) - 2

    @property
    def tokenizer(self) -> Any:
        return self.tok

    def close(self) -> None:
        self.target = self.draft = None

    def explain(self) -> dict[str, dict[str, Any]]:
        """Per source: rounds, tokens proposed/accepted, whether it ran and why not (``engines.explain``)."""
        chooser = (f"the cost model, per row and round (proposers={self.proposers})"
                   if self.proposers and self.verify == "cost" else None)
        # the decode loop's reasons (``dspine.decoding.explain``: its estimates against the live prices); its own
        # counts are per stream, the tally's per result, so only the reason is taken; the settings' reason
        # (``_why``: the user switched the source off) comes first, it is the one the user can act on
        extra = {src: ({"chooser": chooser} if chooser else {})
                 | ({"why": self.decisions[src]["why"], "stopped": bool(self.decisions[src].get("stopped"))}
                    if (self.decisions.get(src) or {}).get("why") and self._why(src, False) is None else {})
                 for src in SOURCES}
        return self.tally.explain(self._why, extra)

    def _why(self, source: str, ran: bool) -> str | None:
        """The reasons the settings give; the cost model's own (under ``auto``) come from the decode loop."""
        if ran:
            return None
        if self.proposers is None:
            return "plain decoding, no speculation (no draft: --draft none, or none fits this model)"
        if source == "dspine" and self.draft is None:
            return "no DSpine draft for this model (suffix matches only)"
        if source == "dspine" and self.proposers == "suffix":
            return "--engine-arg proposers=suffix (suffix matches only)"
        if source == "suffix" and self.proposers == "dspine":
            return ("verify=fixed verifies the draft's whole block" if self.verify == "fixed"
                    else "--engine-arg proposers=dspine (the draft only)")
        return None

    def run(self, requests: Iterable[Request], max_in_flight: int) -> Iterator[Result]:
        from dspine.decoding.decode import decode_stream
        from dspine.decoding.sampling import SamplingParams

        size = max(1, min(self.batch_size, max_in_flight))
        room = int(self.target.max_position) - 1
        pending: dict[int, Request] = {}
        refused: dict[int, str] = {}

        def feed():
            for i, r in enumerate(requests):
                pending[i] = r
                p = r.params
                try:
                    sp = SamplingParams(max(0, min(p.max_new_tokens, room - len(r.prompt_ids))), p.temperature,
                                        p.top_p, p.top_k, p.seed, tuple(p.stop_token_ids),
                                        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
                                        logit_bias=p.logit_bias, logprobs=p.top_logprobs if p.logprobs else None,
                                        grammar=self._constraint(p.structure))
                except ValueError as e:  # the decoder refuses an empty prompt: the row gets this error instead
                    refused[i] = str(e)
                    yield [], SamplingParams(max_new_tokens=0)
                    continue
                yield r.prompt_ids, sp

        stream = decode_stream(self.target, self.draft if self.proposers else None, feed(), size,
                               self.block_size if self.draft is not None else None, self.dynamic_threshold,
                               self.verify if self.proposers else "fixed", self._cost(size), self.accept_prior,
                               proposers=self.proposers or "dspine", suffix_cap=self.suffix_cap,
                               suffix_max=self.suffix_max, prefix_cache=self.prefix,
                               prefill_chunk=self.prefill_chunk, decisions=self.decisions, release_retired=True)
        try:
            for i, out in stream:
                req = pending.pop(i)
                if out.error is not None:
                    yield Result(req.row_id, req.sample_index, prompt_tokens=len(req.prompt_ids),
                                 error=f"engine rejected the request: {refused.pop(i, out.error)}")
                else:
                    yield self._result(req, out)
        except RuntimeError as e:
            raise FatalError(f"reference engine failed: {e}") from e

    def score(self, requests: list[Request]) -> list[Result]:
        """Scoring requests (``base.Scorer``): ``dspine.decoding.score`` on ``batch_size`` rows at a time, their
        prompts prefilled as the decoding loop does (the prefix cache and chunked prefill included); no decoding."""
        from dspine.cpu.threads import Governor
        from dspine.decoding.score import continuation_logprobs
        from dspine_batch.engines.scoring import score_requests

        gov = getattr(self, "_score_governor", None)
        if gov is None:  # one for the engine's life: it decides from two samples in a row, across calls
            gov = self._score_governor = Governor()

        def run(batch: list[Request]) -> list[list[list[float]]]:
            return continuation_logprobs(self.target, [r.prompt_ids for r in batch],
                                         [r.continuations or () for r in batch], self.prefix, self.prefill_chunk,
                                         gov)

        return score_requests(requests, int(self.target.max_position), self.batch_size, run)

    def _constraint(self, structure: Any) -> Any:
        """The compiled grammar of a request's ``Structure`` (each distinct one compiled once per engine), or
        None. An invalid one raises ValueError (the row's error; the pipeline checks them before the model
        loads)."""
        if structure is None:
            return None
        if self._grammars is None:
            from dspine.decoding.grammar import Grammars

            raw = self.tok.tok  # forced strings are tokenized without special tokens
            self._grammars = Grammars.for_hf_dir(str(self.model_path), int(self.target.vocab_size),
                                                 list(self.tok.eos_ids()),
                                                 lambda s: raw.encode(s, add_special_tokens=False).ids)
        return self._grammars.get(structure.kind, structure.spec)

    def _cost(self, rows: int) -> Any:
        """The calibrated cost model for ``rows`` (cost-aware verification only; cached on disk per identity)."""
        if self.proposers is None or self.verify != "cost":
            return None
        key = (rows, self.proposers)
        if key not in self._costs:
            from dspine.decoding.cost import load_or_calibrate

            draft, block, ident, long = self._cost_args()
            self._costs[key] = load_or_calibrate(self.target, draft, rows, block, ident, long_tokens=long)
        return self._costs[key]

    def _cost_args(self) -> tuple[Any, int, dict[str, Any], int | None]:
        """(draft, block size, identity, long verify) of this engine's calibration."""
        use_draft = self.draft is not None and self.proposers in ("dspine", "auto")
        long = self.suffix_max + 1 if self.proposers in ("suffix", "auto") else None
        ident = {k: self._identity.get(k) for k in ("model", "draft", "dtype")}
        return (self.draft if use_draft else None), (self.block_size if use_draft else 2), ident, long

    def prepare(self, max_in_flight: int) -> str:
        """Measure now, and cache, what a run with this in-flight window would measure at its start on this machine
        (the cost model of its batch shape); says what it did (``dspine-batch prepare``)."""
        rows = max(1, min(self.batch_size, max_in_flight))
        if self.proposers is None or self.verify != "cost":
            return "not needed (no cost-aware verification with these settings)"
        from dspine.decoding.cost import cache_dir, cache_key

        draft, block, ident, long = self._cost_args()
        path = cache_dir() / f"{cache_key(ident, self.target, rows, block, long)}.json"
        if path.is_file():
            self._cost(rows)
            return f"already calibrated for {rows} rows ({path})"
        self._cost(rows)
        if path.is_file():
            return f"calibrated for {rows} rows, cached in {path}"
        return (f"calibrated for {rows} rows but not cached: the machine was busy (load above its cores) or the "
                "cache is not writable; each run calibrates at its start until one finds it quiet")

    def _result(self, req: Request, out: Any) -> Result:
        tokens = list(out.token_ids)
        text = self.tok.decode(tokens)
        finish = out.finish_reason
        cut = cut_at_stop(text, tokens, req.params.stop, self.tok.decode)
        if cut is not None:
            (text, tokens), finish = cut, "stop"
        res = Result(req.row_id, req.sample_index, tokens, text, finish, out.prompt_tokens, len(tokens),
                     latency_s=float(getattr(out, "latency_s", 0.0)),
                     cached_prompt_tokens=int(getattr(out, "cached_prompt_tokens", 0)))
        if out.logprobs is not None:  # (id, logprob, top) per kept token (a stop string may have cut some)
            res.logprobs = [(t, lp, tuple(top)) for t, lp, top in out.logprobs[: len(tokens)]]
        st = out.stats
        if self.proposers:  # plain steps (ℓ = 0) are not verify rounds: see dspine.decoding.decode.SpecStats
            res.verify_steps = st.verify_steps
            res.draft_tokens_proposed = st.draft_tokens_proposed
            res.draft_tokens_accepted = st.draft_tokens_accepted
            res.accept_length = float(st.accept_length) if st.verify_steps else None
            res.accept_histogram = list(st.accept_histogram)
            if self.proposers == "dspine":  # the old loop: every verify round is the draft's
                res.dspine_verify_steps, res.dspine_tokens_proposed, res.dspine_tokens_accepted = (
                    st.verify_steps, st.draft_tokens_proposed, st.draft_tokens_accepted)
                res.suffix_verify_steps = res.suffix_tokens_proposed = res.suffix_tokens_accepted = 0
            else:
                res.dspine_verify_steps, res.dspine_tokens_proposed, res.dspine_tokens_accepted = (
                    st.dspine_steps, st.dspine_proposed, st.dspine_accepted)
                res.suffix_verify_steps, res.suffix_tokens_proposed, res.suffix_tokens_accepted = (
                    st.suffix_steps, st.suffix_proposed, st.suffix_accepted)
                res.forced_verify_steps, res.forced_tokens_proposed, res.forced_tokens_accepted = (
                    st.forced_steps, st.forced_proposed, st.forced_accepted)
        return self.tally.add(res)


