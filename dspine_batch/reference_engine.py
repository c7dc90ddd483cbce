"""The CPU reference engine: ``dspine.generate`` (speculative with a DSpine draft, plain AR without).

``dspine.generate`` is batch-synchronous, so ``run`` pulls up to ``batch_size`` requests, generates them in
one call with per-request sampling lists, and yields the results; admission stops as soon as the request
iterator does. A batch that ``generate`` rejects (e.g. one over-long prompt) is retried request by request so
one bad row cannot fail its neighbours. Stop strings are applied after generation (the API takes token ids).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .engine import Request, Result
from .errors import FatalError, UsageError
from .manifest import content_digest
from .tokenizer import HFTokenizer

ARGS = {"batch_size": int, "block_size": int, "threads": int, "dynamic_threshold": float}


def _model_identity(path: Path) -> dict[str, Any]:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".jinja"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.name}:{content_digest(str(p))}".encode())
    return {"path": str(path), "digest": digest.hexdigest()[:24]}


def resolve_model(model: str) -> Path:
    if model == "embedded":
        try:
            from dspine.embedded import embedded_target_path

            return Path(embedded_target_path())
        except ImportError as e:
            raise UsageError(f"--model embedded: the dspine package is not available ({e})") from e
        except Exception as e:  # EmbeddedModelMissing: its message says how to fix it
            raise UsageError(f"--model embedded: {e}") from e
    p = Path(model)
    if not (p / "config.json").exists():
        raise UsageError(f"--model {model}: not a model directory (no config.json)")
    return p


def _warn(msg: str) -> None:
    print(f"dspine-batch: warning: {msg}; running without a draft (speculative stats columns will be null)",
          file=sys.stderr)


def resolve_draft(draft: str, model: str = "embedded") -> Path | None:
    """``embedded`` is the draft trained against the embedded target: with any other model it would be wrong
    (a draft borrows its target's embeddings and head), so it only applies to ``--model embedded``."""
    if draft in ("none", ""):
        return None
    if draft == "embedded":
        if model != "embedded":
            _warn("the embedded draft pairs only with --model embedded; pass --draft PATH for this model, or "
                  "--draft none to silence this")
            return None
        try:
            from dspine import embedded

            path = Path(embedded.embedded_draft_path())  # type: ignore[attr-defined]
            if (path / "config.json").exists():
                return path
            _warn(f"the embedded draft is missing at {path}")
        except Exception as e:  # not shipped in this build, or damaged: generate without speculation
            _warn(f"no embedded draft is available ({str(e)[:200]})")
        return None
    p = Path(draft)
    if not (p / "config.json").exists():
        raise UsageError(f"--draft {draft}: not a draft directory (no config.json)")
    return p


class ReferenceEngine:
    name = "reference"

    def __init__(self, target: Any, draft: Any, tokenizer: HFTokenizer, model_path: Path, draft_path: Path | None,
                 batch_size: int, block_size: int | None, dynamic_threshold: float | None = None):
        self.target, self.draft, self.tok = target, draft, tokenizer
        self.model_path, self.draft_path = model_path, draft_path
        self.batch_size = batch_size
        self.block_size = block_size or (int(draft.block_size) if draft is not None else None)
        # Confidence-based early stop of each proposal (lossless; needs a fitted confidence head, else ignored).
        self.dynamic_threshold = dynamic_threshold if draft is not None and draft.confidence_enabled else None
        self._identity = {"engine": "reference", "model": _model_identity(model_path),
                          "draft": _model_identity(draft_path) if draft_path else None,
                          "block_size": self.block_size, "dtype": "float32"}
        if self.dynamic_threshold is not None:
            self._identity["dynamic_threshold"] = self.dynamic_threshold

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
        import torch

        from dspine import load_draft, load_target
        from dspine.draft_io import read_decode_defaults

        if "threads" in opts:
            torch.set_num_threads(opts["threads"])
        model_path = resolve_model(model)
        draft_path = resolve_draft(draft, model)
        try:
            target = load_target(model_path, dtype=torch.float32, device="cpu")
            drafter = load_draft(draft_path) if draft_path else None
            defaults = read_decode_defaults(draft_path) if draft_path else {}
        except (ValueError, OSError) as e:  # ModelLoadError is a ValueError
            raise UsageError(f"cannot load the model: {e}") from e
        tok = HFTokenizer(model_path)
        # The draft's measured decode settings (decode.json) apply unless --engine-arg sets them.
        block_size = opts.get("block_size", defaults.get("block_size"))
        if drafter is not None and block_size is not None and not 2 <= block_size <= drafter.block_size:
            raise UsageError(f"block_size {block_size}: the draft supports 2..{drafter.block_size}")
        return cls(target, drafter, tok, model_path, draft_path, opts.get("batch_size", 8), block_size,
                   opts.get("dynamic_threshold", defaults.get("dynamic_threshold")))

    def identity(self) -> dict[str, Any]:
        return self._identity

    @property
    def max_context(self) -> int | None:
        return int(self.target.max_position) - (self.block_size or 1) - 1

    @property
    def has_chat_template(self) -> bool:
        return self.tok.has_chat_template

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tok.render_chat(messages)

    def stop_token_ids(self, stop: Iterable[str]) -> tuple[int, ...]:
        return self.tok.stop_token_ids(stop)

    def close(self) -> None:
        self.target = self.draft = None

    def run(self, requests: Iterable[Request], max_in_flight: int) -> Iterator[Result]:
        it = iter(requests)
        size = max(1, min(self.batch_size, max_in_flight))
        while True:
            batch: list[Request] = []
            for req in it:
                batch.append(req)
                if len(batch) >= size:
                    break
            if not batch:
                return
            yield from self._generate(batch)
            if len(batch) < size:
                return

    def _generate(self, batch: list[Request]) -> list[Result]:
        from dspine import generate

        room = int(self.target.max_position) - (self.block_size or 1)
        max_new = [max(0, min(r.params.max_new_tokens, room - len(r.prompt_ids))) for r in batch]
        try:
            outs = generate(self.target, self.draft, [r.prompt_ids for r in batch], max_new_tokens=max_new,
                            temperature=[r.params.temperature for r in batch], top_p=[r.params.top_p for r in batch],
                            top_k=[r.params.top_k for r in batch], seed=[r.params.seed for r in batch],
                            stop_token_ids=[list(r.params.stop_token_ids) for r in batch],
                            block_size=self.block_size if self.draft is not None else None,
                            dynamic_threshold=self.dynamic_threshold)
        except ValueError as e:
            if len(batch) == 1:
                return [Result(batch[0].key, batch[0].sample_index, prompt_tokens=len(batch[0].prompt_ids),
                               error=f"engine rejected the request: {e}")]
            return [res for r in batch for res in self._generate([r])]
        except RuntimeError as e:
            raise FatalError(f"reference engine failed: {e}") from e
        return [self._result(r, o) for r, o in zip(batch, outs, strict=True)]

    def _result(self, req: Request, out: Any) -> Result:
        tokens = list(out.token_ids)
        text = self.tok.decode(tokens)
        finish = out.finish_reason
        for s in req.params.stop:
            cut = text.find(s)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                k = next((k for k in range(1, len(tokens) + 1) if s in self.tok.decode(tokens[:k])), len(tokens))
                tokens = tokens[:k]
        res = Result(req.key, req.sample_index, tokens, text, finish, out.prompt_tokens, len(tokens),
                     latency_s=float(getattr(out, "latency_s", 0.0)))
        st = out.stats
        if self.draft is not None and st.verify_steps:
            res.verify_steps = st.verify_steps
            res.draft_tokens_proposed = st.draft_tokens_proposed
            res.draft_tokens_accepted = st.draft_tokens_accepted
            res.accept_length = float(st.accept_length)
            res.accept_histogram = list(st.accept_histogram)
        return res


