"""The SGLang engine adapter: ``sglang.Engine`` in-process behind the pipeline's ``Engine`` protocol.

* **Server args**: ``args`` (defaults < ``server_flags`` < single ``KEY=VALUE`` engine args). On a machine
  without a GPU the engine runs SGLang's CPU test path (``dspine.sglang.cpu``; slow, for tests and
  development); ``--engine auto`` picks SGLang only with a GPU. ``proposers`` (suffix proposals beside the
  draft) reaches the DSPINE worker as ``DSPINE_PROPOSERS``, set in this process while the engine starts.
* **Requests** go through ``async_generate`` (one ``input_ids`` request each) on the engine's own event loop,
  driven from ``run``'s thread (SGLang installs its signal handlers there); at most ``max_in_flight`` are open
  and the request iterator is pulled lazily, so stopping admission loses no finished work.
* **Scoring** (``base.Scorer``): one ``async_generate`` per (request, continuation) with ``input_ids`` = prompt +
  continuation, no decoding, and SGLang's own input logprobs from the prompt's last token on (``score``).
* **Stats**: per-request ``meta_info`` -> our columns via ``stats`` (all SGLang name vintages), the by-source
  columns from the DSPINE worker's counts; ``explain()`` says per source what ran and why not
  (``engines.explain``).
* **Failures**: a request SGLang aborts becomes a row error (``finish_reason`` abort, the engine's message);
  engine death raises ``EngineDied`` (``processes``); the pipeline then commits finished rows and exits
  75 (run again to resume).
* **Shutdown** kills only the processes SGLang started (``processes.scoped_shutdown``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dspine_batch.engines.base import FEATURES, Request, Result
from dspine_batch.engines.explain import SourceTally
from dspine_batch.engines.models import model_identity, open_tokenizer, resolve_draft, resolve_model
from dspine_batch.engines.sglang import logprobs as sglang_logprobs
from dspine_batch.engines.sglang import stats as sglang_stats
from dspine_batch.engines.sglang.args import (  # noqa: F401  (re-exported: the adapter's public names)
    ADAPTER_KEYS,
    OPERATIONAL_KEYS,
    PROPOSERS_ENV,
    TOP_K_ALL,
    build_server_kwargs,
    logprob_args,
    parse_server_flags,
    sampling_params,
)
from dspine_batch.engines.sglang.processes import (  # noqa: F401  (re-exported)
    _SIGQUIT,
    EngineDied,
    _child_pids,
    close_contexts,
    kill_owned,
    on_sigquit,
    reclaim_signals,
    scoped_shutdown,
    zmq_contexts,
)
from dspine_batch.engines.stop_strings import cut_at_stop
from dspine_batch.errors import UsageError

# Per-request seeds (issue 57, finding 4): SGLang 0.5.23 reads ``sampling_seed`` only under
# --enable-deterministic-inference (and then not with flashinfer's top-k/top-p sampler); DSPINE's draft walk and
# verify draw from the global generator as DFlash's do. Sampled rows are exact in law, not reproducible: said once.
SEEDS_NOTE = ("dspine-batch: note: SGLang does not honour per-request seeds: sampled rows follow the model's law but "
              "are not reproducible run to run (--engine reference reproduces them)")


def sglang_available(need_gpu: bool = True) -> tuple[bool, str]:
    """(usable, why): SGLang importable here and (``need_gpu``) everything a GPU run needs (``readiness.check``, what
    ``--engine auto`` asks). ``--engine sglang`` without a GPU runs SGLang's CPU test path instead."""
    import importlib.util

    if not need_gpu:
        if importlib.util.find_spec("sglang") is None:
            return False, "sglang is not installed in this interpreter"
        return True, "sglang is installed"
    from dspine_batch.engines.sglang.readiness import check

    ready = check()
    return ready.ok, ready.why


def on_cpu() -> bool:
    """No CUDA GPU here: SGLang runs its CPU test path (``dspine.sglang.cpu``)."""
    import torch

    return not torch.cuda.is_available()


class SGLangEngine:
    name = "sglang"
    # every request feature (base.FEATURES), under DSPINE speculation too: the DSPINE worker processes each verify
    # slot with its own history and reports the model's own logprobs (dspine.sglang.processing, .sampling)
    features: frozenset[str] = FEATURES

    def __init__(self, engine: Any, tokenizer: Any, identity: dict[str, Any], block_size: int | None,
                 max_context: int | None, owned_pids: set[int], poll_seconds: float = 1.0,
                 loop: asyncio.AbstractEventLoop | None = None, watch_pids: set[int] | None = None,
                 meta_log: str | None = None, proposers: str | None = None):
        self._engine = engine
        self.tok = tokenizer
        self._identity = identity
        self.block_size = block_size
        self._max_context = max_context
        self._owned = set(owned_pids)  # killed on close (the engine's whole process tree)
        self._watch = set(watch_pids if watch_pids is not None else owned_pids)  # must stay alive
        self._poll = poll_seconds
        self._meta_log = meta_log
        self._loop = loop or getattr(engine, "loop", None) or asyncio.new_event_loop()
        self._old_sigquit = None
        self._contexts_before = None
        self.proposers = proposers  # DSPINE's proposal sources (None: no DSPINE speculation)
        self.tally = SourceTally()
        self._said_seeds = False

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, draft: str, args: dict[str, str],
             engine_factory: Callable[..., Any] | None = None, tokenizer: Any = None,
             server_parser: Any = None) -> SGLangEngine:
        model_path = resolve_model(model)
        draft_path = resolve_draft(draft, model)
        cpu = engine_factory is None and on_cpu()
        from dspine_batch.engines.sglang.readiness import gpu_dtype

        kwargs, opts = build_server_kwargs(str(model_path), None if draft_path is None else str(draft_path), args,
                                           parser=server_parser, on_cpu=cpu,
                                           gpu_dtype=None if cpu or engine_factory is not None else gpu_dtype())
        if str(kwargs.get("speculative_algorithm") or "").upper() == "DSPINE":
            from dspine.sglang.config import check_target, read_draft, resolve_block_size

            try:  # the same checks the plugin runs at ServerArgs resolution, before any process starts
                info = read_draft(draft_path)
                resolve_block_size(kwargs.get("speculative_num_draft_tokens"),
                                   kwargs.get("speculative_dflash_block_size"), info)
                check_target(model_path, info)
            except ValueError as e:
                raise UsageError(f"--engine sglang: {e}") from e
        if engine_factory is None:
            ok, why = sglang_available(need_gpu=False)
            if not ok:
                raise UsageError(f"--engine sglang: {why} (use --engine reference)")
            if cpu:
                print("dspine-batch: note: no GPU here; SGLang runs its CPU test path (slow)", file=sys.stderr)
            if str(kwargs.get("speculative_algorithm") or "").upper() == "DSPINE":
                from dspine.sglang.plugin import ensure_available

                try:
                    ensure_available()
                except RuntimeError as e:
                    raise UsageError(str(e)) from e
            import sglang

            engine_factory = sglang.Engine
        if tokenizer is None:
            tokenizer = open_tokenizer(model_path)
        block = _block_size(kwargs, draft_path)
        proposers = opts.get("proposers")
        identity = {"engine": "sglang", "sglang_version": _sglang_version(),
                    "model": model_identity(model_path),
                    "draft": model_identity(draft_path) if draft_path else None, "block_size": block,
                    "server_args": {k: _jsonable(v) for k, v in sorted(kwargs.items())
                                    if k not in OPERATIONAL_KEYS and k not in ("model_path",
                                                                                "speculative_draft_model_path")}}
        if proposers not in (None, "dspine"):  # sampled rows then verify other proposals: other tokens
            identity["proposers"] = proposers
        identity["seeds"] = "not honoured"  # SEEDS_NOTE: a resumed run's sampled rows are new draws
        max_ctx = kwargs.get("context_length") or _config_max_position(model_path)
        _SIGQUIT.clear()
        main = threading.current_thread() is threading.main_thread()
        old = signal.getsignal(signal.SIGQUIT) if main else None
        ours = {signal.SIGTERM: signal.getsignal(signal.SIGTERM), signal.SIGQUIT: on_sigquit} if main else {}
        before = _child_pids()
        contexts_before = zmq_contexts()
        from dspine.sglang.sampling import engine_env

        env = engine_env()  # the request contract's semantics in SGLang's processes (dspine.sglang.sampling)
        if proposers is not None:  # read by the DSPINE worker in the scheduler processes started here
            env[PROPOSERS_ENV] = proposers
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            engine = engine_factory(**kwargs)
        except (TypeError, ValueError) as e:  # bad ServerArgs / resolution errors (incl. DSPINE's checks)
            kill_owned(_child_pids() - before)  # whatever it had started
            close_contexts(contexts_before)  # and the ZeroMQ contexts it had made (close() never comes)
            raise UsageError(f"--engine sglang: {e}") from e
        except Exception as e:
            from dspine_batch.errors import FatalError

            kill_owned(_child_pids() - before)
            close_contexts(contexts_before)
            raise FatalError(f"--engine sglang: the engine failed to start: {type(e).__name__}: {e}") from e
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self = cls(engine, tokenizer, identity, block, None if max_ctx is None else int(max_ctx) - (block or 1) - 1,
                   _child_pids() - before, opts["poll_seconds"], meta_log=opts["meta_log"], proposers=proposers,
                   watch_pids=_child_pids(recursive=False) - before)  # scheduler(s), detokenizer
        self._old_sigquit = old
        self._contexts_before = contexts_before  # close() destroys the ZeroMQ contexts SGLang made since
        reclaim_signals(engine, ours, self._loop)
        return self

    # -- protocol -------------------------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return self._identity

    @property
    def max_context(self) -> int | None:
        return self._max_context

    @property
    def tokenizer(self) -> Any:
        return self.tok

    def run(self, requests: Iterable[Request], max_in_flight: int) -> Iterator[Result]:
        if self._engine is None:
            raise EngineDied("the SGLang engine is closed")
        self._check_alive()
        loop = self._loop
        it = iter(requests)
        pending: dict[asyncio.Task, tuple[Request, str]] = {}
        exhausted = False
        window = max(1, int(max_in_flight))
        try:
            while True:
                while not exhausted and len(pending) < window:
                    req = next(it, None)
                    if req is None:
                        exhausted = True
                        break
                    if req.params.temperature > 0 and not self._said_seeds:
                        self._said_seeds = True
                        print(SEEDS_NOTE, file=sys.stderr)
                    rid = f"{req.row_id}#{req.sample_index}#{uuid.uuid4().hex[:12]}"
                    pending[loop.create_task(self._one(req, rid))] = (req, rid)
                if not pending:
                    return
                done, _ = loop.run_until_complete(
                    asyncio.wait(list(pending), timeout=self._poll, return_when=asyncio.FIRST_COMPLETED))
                self._check_alive()
                for task in done:
                    req, _rid = pending.pop(task)
                    yield self._result(req, task.result())
        finally:
            if pending:
                self._abandon(pending)

    def score(self, requests: list[Request]) -> list[Result]:
        """Scoring requests (``base.Scorer``) through ``scoring.score_requests``: each continuation is the tail of one
        request's ``input_ids``, SGLang's input logprobs (the raw logits' log-softmax, ``dspine.sglang.sampling``)
        read from ``logprob_start_len`` = the prompt's last position on; the prompt prefix is shared through SGLang's
        radix cache. A batch's requests are all open at once."""
        from dspine_batch.engines.scoring import score_requests

        if self._engine is None:
            raise EngineDied("the SGLang engine is closed")
        self._check_alive()
        # no token is decoded on the plain engine; a speculative one decodes one (its prefill-only path is plain's)
        new = 1 if self._identity.get("server_args", {}).get("speculative_algorithm") else 0

        async def one(prompt: list[int], cont: tuple[int, ...]) -> list[float]:
            out = await self._engine.async_generate(
                input_ids=list(prompt) + list(cont), sampling_params={"max_new_tokens": new, "temperature": 0.0},
                return_logprob=True, logprob_start_len=len(prompt) - 1, rid=f"score#{uuid.uuid4().hex[:12]}")
            return sglang_logprobs.continuation(out[0] if isinstance(out, list) else out, cont)

        def run(batch: list[Request]) -> list[list[list[float]]]:
            async def all_of() -> list[list[float]]:
                return await asyncio.gather(*(one(r.prompt_ids, c) for r in batch for c in r.continuations or ()))

            flat = iter(self._loop.run_until_complete(all_of()))
            self._check_alive()
            return [[next(flat) for _ in r.continuations or ()] for r in batch]

        return score_requests(requests, self._max_context or sys.maxsize, self._batch_size(), run)

    def _batch_size(self) -> int:
        """Scoring requests open at once: SGLang's own running-request cap when set, else 64."""
        cap = self._identity.get("server_args", {}).get("max_running_requests")
        return int(cap) if isinstance(cap, int) and cap > 0 else 64

    def explain(self) -> dict[str, dict[str, Any]]:
        """Per source: rounds, tokens proposed/accepted, whether it ran and why not (``engines.explain``)."""
        chooser = ("greedy rows, where a suffix match's estimate beats the draft's record (proposers=auto)"
                   if self.proposers == "auto" else None)
        return self.tally.explain(self._why, {"suffix": {"chooser": chooser}} if chooser else None)

    def _why(self, source: str, ran: bool) -> str | None:
        if ran:
            return None
        if self.proposers is None:
            return "no DSPINE speculation (no draft, or another speculative algorithm)"
        if source == "suffix" and self.proposers == "dspine":
            return "--engine-arg proposers=dspine (the draft only)"
        return None

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            scoped_shutdown(engine, self._owned, self._contexts_before)
        finally:
            if self._old_sigquit is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGQUIT, self._old_sigquit)

    # -- internals ------------------------------------------------------------------------------------------------
    async def _one(self, req: Request, rid: str) -> dict[str, Any] | BaseException:
        try:
            return await self._engine.async_generate(input_ids=list(req.prompt_ids),
                                                     sampling_params=sampling_params(req.params), rid=rid,
                                                     **logprob_args(req.params))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # request-level failure (bad request, abort raised as an error, ...)
            return e

    def _check_alive(self) -> None:
        if _SIGQUIT.is_set():
            raise EngineDied("the SGLang engine died (a scheduler/detokenizer process crashed; SGLang's "
                             "watchdog sent SIGQUIT); see the SGLang log above")
        if self._watch:
            import psutil

            gone = []
            for pid in self._watch:
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        gone.append(pid)
                except psutil.NoSuchProcess:
                    gone.append(pid)
            if gone:
                raise EngineDied(f"the SGLang engine died: its processes {sorted(gone)} exited")

    def _abandon(self, pending: dict) -> None:
        """Abort unfinished requests in the engine and cancel their tasks (stop signal, error, death)."""
        tm = getattr(self._engine, "tokenizer_manager", None) if self._engine is not None else None
        for task, (_req, rid) in pending.items():
            if tm is not None and hasattr(tm, "abort_request"):
                try:
                    tm.abort_request(rid=rid)
                except Exception:
                    pass
            task.cancel()
        try:
            self._loop.run_until_complete(asyncio.wait(list(pending), timeout=5.0))
        except Exception:
            pass

    def _result(self, req: Request, out: dict[str, Any] | BaseException) -> Result:
        res = Result(req.row_id, req.sample_index, prompt_tokens=len(req.prompt_ids))
        if isinstance(out, BaseException):
            res.error = f"engine rejected the request: {type(out).__name__}: {out}"
            return res
        if isinstance(out, list):  # one request in, one dict out; tolerate a batch-shaped answer
            out = out[0]
        meta = out.get("meta_info") or {}
        if self._meta_log:
            with open(self._meta_log, "a") as f:
                f.write(json.dumps({"key": req.row_id, "sample_index": req.sample_index, "meta_info": meta},
                                   default=str) + "\n")
        finish, err = sglang_stats.finish(meta)
        tokens = [int(t) for t in out.get("output_ids") or []]
        res.token_ids, res.finish_reason, res.error = tokens, finish, err
        res.completion_tokens = len(tokens)
        try:
            sglang_stats.apply(meta, res, block_size=self.block_size, dspine=self.proposers is not None)
        except ValueError as e:
            res.error = res.error or f"unreadable SGLang meta_info: {e}"
        if req.params.logprobs:
            try:
                res.logprobs = sglang_logprobs.logprobs(meta, len(tokens))
            except ValueError as e:
                res.error = res.error or f"unreadable SGLang logprobs: {e}"
        text = self.tok.decode(tokens) if tokens else ""
        cut = cut_at_stop(text, tokens, req.params.stop, self.tok.decode)
        if cut is not None:
            (text, res.token_ids), res.finish_reason = cut, "stop"
            res.completion_tokens = len(res.token_ids)
            if res.logprobs is not None:
                res.logprobs = res.logprobs[: len(res.token_ids)]
        res.text = text
        return self.tally.add(res)


def _block_size(kwargs: dict[str, Any], draft_path: Path | None) -> int | None:
    if draft_path is None:
        return None
    if kwargs.get("speculative_num_draft_tokens"):
        return int(kwargs["speculative_num_draft_tokens"])
    import json

    try:
        cfg = json.loads((Path(draft_path) / "config.json").read_text())
        return int((cfg.get("dflash_config") or {}).get("block_size") or cfg.get("block_size") or 16)
    except (OSError, ValueError):
        return None


def _config_max_position(model_path: Path) -> int | None:
    import json

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    v = cfg.get("max_position_embeddings")
    return int(v) if v else None


def _sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, str | int | float | bool | type(None)) else repr(v)
