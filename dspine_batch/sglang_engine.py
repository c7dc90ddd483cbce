"""The SGLang engine adapter: ``sglang.Engine`` in-process behind the pipeline's ``Engine`` protocol.

* **Server args** come from, in increasing precedence: our defaults (``model_path``, ``DSPINE`` with the
  draft, ``skip_tokenizer_init``: we tokenize and render chat templates ourselves, exactly as the reference
  engine does), ``--engine-arg server_flags="..."`` (any ``sglang serve`` flags, e.g. the seed command's,
  parsed by SGLang's own argument parser), then single ``--engine-arg KEY=VALUE`` (a ``ServerArgs`` field,
  ``-`` or ``_``, typed by the same parser; a job file's ``engine_args`` table arrives the same way).
* **Requests** go through ``async_generate`` (one ``input_ids`` request each) on the engine's own event loop,
  driven from ``run``'s thread (SGLang installs its signal handlers there); at most ``max_in_flight`` are open
  and the request iterator is pulled lazily, so stopping admission loses no finished work.
* **Stats**: per-request ``meta_info`` -> our columns via ``sglang_stats`` (all SGLang name vintages).
* **Failures**: a request SGLang aborts becomes a row error (``finish_reason`` abort, the engine's message);
  engine death (a SIGQUIT from SGLang's subprocess watchdog, or a scheduler/detokenizer child gone) raises
  ``EngineDied``; the pipeline then commits finished rows and exits 75 (run again to resume).
* **Shutdown** kills only the processes SGLang started (``Engine.shutdown`` would otherwise SIGKILL every
  descendant of this process: ``kill_process_tree(os.getpid(), include_parent=False)``).
"""

from __future__ import annotations

import asyncio
import difflib
import os
import shlex
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from . import sglang_stats
from .engine import Request, Result, SamplingParams
from .errors import EngineDied, UsageError
from .stop_strings import cut_at_stop

ADAPTER_KEYS = ("server_flags", "block_size", "poll_seconds")
# ServerArgs that change how fast, not what: left out of the run fingerprint so they can change on resume.
OPERATIONAL_KEYS = frozenset({
    "mem_fraction_static", "max_running_requests", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill",
    "cuda_graph_bs_decode", "cuda_graph_bs_prefill", "disable_cuda_graph", "min_free_slots_delay",
    "max_mamba_cache_size", "log_level", "custom_sigquit_handler", "port", "host", "chunked_prefill_size",
    "max_prefill_tokens", "enable_metrics", "tool_call_parser", "reasoning_parser", "disable_overlap_schedule",
    "attention_backend", "speculative_draft_attention_backend", "sampling_backend", "linear_attn_backend",
    "max_total_tokens", "schedule_policy", "mamba_radix_cache_strategy",
})
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" (sampling_params.TOP_K_ALL)


# -- engine death: SGLang's SubprocessWatchdog SIGQUITs the parent when a child crashes ------------------------
_SIGQUIT = threading.Event()


def on_sigquit(signum, frame) -> None:  # module level: ServerArgs (with this handler) is pickled to children
    _SIGQUIT.set()


# -- server args ------------------------------------------------------------------------------------------------


def _sglang_parser():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang", add_help=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # we parse fragments (one flag at a time); --model-path is ours anyway
        action.required = False
    return parser


def parse_server_flags(argv: list[str], parser=None) -> dict[str, Any]:
    """``sglang serve``-style flags -> {ServerArgs field: typed value}, only for the flags actually given."""
    parser = parser or _sglang_parser()
    if argv[:2] == ["sglang", "serve"]:
        argv = argv[2:]
    opt_to_dest = {o: a.dest for a in parser._actions for o in a.option_strings}
    given = []
    for a in argv:
        if a.startswith("--"):
            opt = a.split("=", 1)[0]
            if opt not in opt_to_dest:
                close = difflib.get_close_matches(opt, list(opt_to_dest), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise UsageError(f"SGLang flag {opt}: unknown{hint}")
            given.append(opt_to_dest[opt])
    try:
        ns, extra = parser.parse_known_args(argv)
    except (Exception, SystemExit) as e:  # argparse.ArgumentError (exit_on_error=False) or its error() exit
        raise UsageError(f"SGLang flags {shlex.join(argv)!r}: {e}") from e
    if extra:
        raise UsageError(f"SGLang flags: cannot parse {shlex.join(extra)!r}")
    return {d: getattr(ns, d) for d in given}


def _typed_value(key: str, value: Any, parser) -> dict[str, Any]:
    """One ``KEY=VALUE`` engine arg -> {ServerArgs field: value typed by SGLang's own parser}."""
    opt = "--" + key.replace("_", "-")
    action = next((a for a in parser._actions if opt in a.option_strings), None)
    if action is None:
        names = [o[2:].replace("-", "_") for a in parser._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(key, names, n=3)
        raise UsageError(f"--engine-arg {key}: not an SGLang server argument"
                         + (f" (did you mean {', '.join(close)}?)" if close else "")
                         + f"; adapter keys: {', '.join(ADAPTER_KEYS)}")
    if action.nargs == 0:  # a switch: the field takes the boolean the user gave
        if isinstance(value, bool):
            return {action.dest: value}
        v = str(value).strip().lower()
        if v not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise UsageError(f"--engine-arg {key}={value}: expected true or false")
        return {action.dest: v in ("1", "true", "yes", "on")}
    return parse_server_flags([opt, str(value)], parser)


def build_server_kwargs(model_path: str, draft_path: str | None, engine_args: dict[str, Any],
                        parser=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ServerArgs kwargs, adapter options). Precedence: defaults < server_flags < single KEY=VALUE args."""
    parser = parser or _sglang_parser()
    args = {k.replace("-", "_"): v for k, v in engine_args.items()}
    opts: dict[str, Any] = {"poll_seconds": 1.0}
    kwargs: dict[str, Any] = {"model_path": str(model_path), "skip_tokenizer_init": True, "log_level": "error"}
    if draft_path is not None:
        kwargs.update(speculative_algorithm="DSPINE", speculative_draft_model_path=str(draft_path))
    flags = args.pop("server_flags", None)
    if flags:
        parsed = parse_server_flags(shlex.split(str(flags)), parser)
        for key in ("model_path", "speculative_draft_model_path"):  # --model / --draft decide these
            if key in parsed and parsed.pop(key) != kwargs.get(key):
                print(f"dspine-batch: note: server_flags {key} ignored (--model/--draft decide it)", file=sys.stderr)
        kwargs.update(parsed)
    if "block_size" in args:
        args["speculative_num_draft_tokens"] = args.pop("block_size")
    if "poll_seconds" in args:
        try:
            opts["poll_seconds"] = float(args.pop("poll_seconds"))
        except ValueError as e:
            raise UsageError(f"--engine-arg poll_seconds: {e}") from e
    for key, value in args.items():
        if key in ("model_path", "speculative_draft_model_path"):
            raise UsageError(f"--engine-arg {key}: use --model/--draft instead")
        kwargs.update(_typed_value(key, value, parser))
    if draft_path is None and kwargs.get("speculative_algorithm"):
        raise UsageError(f"--engine-arg speculative_algorithm={kwargs['speculative_algorithm']} needs --draft PATH")
    kwargs["custom_sigquit_handler"] = on_sigquit
    return kwargs, opts


def sampling_params(p: SamplingParams) -> dict[str, Any]:
    """Our per-request sampling settings -> SGLang ``sampling_params`` (stop strings applied afterwards, as the
    reference engine does: SGLang runs without a tokenizer here)."""
    sp: dict[str, Any] = {"max_new_tokens": int(p.max_new_tokens), "temperature": float(p.temperature),
                          "top_p": float(p.top_p), "top_k": int(p.top_k) if p.top_k > 0 else TOP_K_ALL,
                          "stop_token_ids": list(p.stop_token_ids), "skip_special_tokens": False}
    if p.temperature > 0:
        sp["sampling_seed"] = int(p.seed)
    return sp


def sglang_available() -> tuple[bool, str]:
    """(usable, why) for ``--engine auto``: SGLang importable here and a CUDA GPU visible."""
    try:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            return False, "sglang is not installed in this interpreter"
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA GPU is visible"
    except Exception as e:  # pragma: no cover - broken installs
        return False, f"cannot check for SGLang: {e}"
    return True, "sglang and a CUDA GPU are available"


# -- the engine ---------------------------------------------------------------------------------------------------


def _child_pids(recursive: bool = True) -> set[int]:
    import psutil

    try:
        return {c.pid for c in psutil.Process().children(recursive=recursive)}
    except psutil.Error:
        return set()


def kill_owned(pids: Iterable[int], timeout: float = 60.0) -> None:
    """SIGKILL these processes and their descendants (only these), then wait for them."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += p.children(recursive=True) + [p]
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def scoped_shutdown(engine: Any, owned: set[int]) -> None:
    """``engine.shutdown()`` with its ``kill_process_tree(os.getpid(), ...)`` limited to the engine's own
    processes (those that appeared while it started), so other children of this process survive."""
    module = sys.modules.get(type(engine).__module__)
    original = getattr(module, "kill_process_tree", None)
    me = os.getpid()

    def limited(parent_pid=None, include_parent: bool = True, skip_pid=None, wait_timeout=60):
        if parent_pid in (None, me):
            kill_owned(owned - ({skip_pid} if skip_pid else set()), wait_timeout or 60)
            return None
        return original(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)

    if original is not None:
        module.kill_process_tree = limited
    try:
        engine.shutdown()
    finally:
        if original is not None:
            module.kill_process_tree = original
        kill_owned(owned)  # whatever shutdown left behind, but nothing else


class SGLangEngine:
    name = "sglang"

    def __init__(self, engine: Any, tokenizer: Any, identity: dict[str, Any], block_size: int | None,
                 max_context: int | None, owned_pids: set[int], poll_seconds: float = 1.0,
                 loop: asyncio.AbstractEventLoop | None = None, watch_pids: set[int] | None = None):
        self._engine = engine
        self.tok = tokenizer
        self._identity = identity
        self.block_size = block_size
        self._max_context = max_context
        self._owned = set(owned_pids)  # killed on close (the engine's whole process tree)
        self._watch = set(watch_pids if watch_pids is not None else owned_pids)  # must stay alive
        self._poll = poll_seconds
        self._loop = loop or getattr(engine, "loop", None) or asyncio.new_event_loop()
        self._old_sigquit = None

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, draft: str, args: dict[str, str],
             engine_factory: Callable[..., Any] | None = None, tokenizer: Any = None) -> SGLangEngine:
        from .reference_engine import _model_identity, resolve_draft, resolve_model

        model_path = resolve_model(model)
        draft_path = resolve_draft(draft, model)
        kwargs, opts = build_server_kwargs(str(model_path), None if draft_path is None else str(draft_path), args)
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
            ok, why = sglang_available()
            if not ok:
                raise UsageError(f"--engine sglang: {why} (use --engine reference on CPU)")
            if str(kwargs.get("speculative_algorithm") or "").upper() == "DSPINE":
                from dspine.sglang.plugin import ensure_available

                try:
                    ensure_available()
                except RuntimeError as e:
                    raise UsageError(str(e)) from e
            import sglang

            engine_factory = sglang.Engine
        if tokenizer is None:
            from .tokenizer import HFTokenizer

            tokenizer = HFTokenizer(model_path)
        block = _block_size(kwargs, draft_path)
        identity = {"engine": "sglang", "sglang_version": _sglang_version(),
                    "model": _model_identity(model_path),
                    "draft": _model_identity(draft_path) if draft_path else None, "block_size": block,
                    "server_args": {k: _jsonable(v) for k, v in sorted(kwargs.items())
                                    if k not in OPERATIONAL_KEYS and k not in ("model_path",
                                                                                "speculative_draft_model_path")}}
        max_ctx = kwargs.get("context_length") or _config_max_position(model_path)
        _SIGQUIT.clear()
        main = threading.current_thread() is threading.main_thread()
        old = signal.getsignal(signal.SIGQUIT) if main else None
        ours = {signal.SIGTERM: signal.getsignal(signal.SIGTERM), signal.SIGQUIT: on_sigquit} if main else {}
        before = _child_pids()
        try:
            engine = engine_factory(**kwargs)
        except (TypeError, ValueError) as e:  # bad ServerArgs / resolution errors (incl. DSPINE's checks)
            kill_owned(_child_pids() - before)  # whatever it had started
            raise UsageError(f"--engine sglang: {e}") from e
        except Exception as e:
            from .errors import FatalError

            kill_owned(_child_pids() - before)
            raise FatalError(f"--engine sglang: the engine failed to start: {type(e).__name__}: {e}") from e
        self = cls(engine, tokenizer, identity, block, None if max_ctx is None else int(max_ctx) - (block or 1) - 1,
                   _child_pids() - before, opts["poll_seconds"],
                   watch_pids=_child_pids(recursive=False) - before)  # scheduler(s), detokenizer
        self._old_sigquit = old
        reclaim_signals(engine, ours)
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

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            scoped_shutdown(engine, self._owned)
        finally:
            if self._old_sigquit is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGQUIT, self._old_sigquit)

    # -- internals ------------------------------------------------------------------------------------------------
    async def _one(self, req: Request, rid: str) -> dict[str, Any] | BaseException:
        try:
            return await self._engine.async_generate(input_ids=list(req.prompt_ids),
                                                     sampling_params=sampling_params(req.params), rid=rid)
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
        finish, err = sglang_stats.finish(meta)
        tokens = [int(t) for t in out.get("output_ids") or []]
        res.token_ids, res.finish_reason, res.error = tokens, finish, err
        res.completion_tokens = len(tokens)
        try:
            sglang_stats.apply(meta, res, block_size=self.block_size)
        except ValueError as e:
            res.error = res.error or f"unreadable SGLang meta_info: {e}"
        text = self.tok.decode(tokens) if tokens else ""
        cut = cut_at_stop(text, tokens, req.params.stop, self.tok.decode)
        if cut is not None:
            (text, res.token_ids), res.finish_reason = cut, "stop"
            res.completion_tokens = len(res.token_ids)
        res.text = text
        return res


def reclaim_signals(engine: Any, handlers: dict[int, Any]) -> None:
    """Undo SGLang's running-phase signal handlers in this process.

    On its first request SGLang's tokenizer manager adds event-loop handlers for SIGTERM (drain and exit) and
    SIGQUIT (``kill_process_tree(os.getpid())``: kills this process too). We create that loop now and put back
    our handlers: SIGTERM stays the pipeline's graceful stop, SIGQUIT only marks the engine dead.
    """
    tm = getattr(engine, "tokenizer_manager", None)
    if tm is None or not handlers or not hasattr(tm, "auto_create_handle_loop"):
        return
    tm.auto_create_handle_loop()
    loop = getattr(tm, "event_loop", None)
    for sig, handler in handlers.items():
        if loop is not None:
            try:
                loop.remove_signal_handler(sig)
            except (ValueError, RuntimeError):
                pass
        if handler is not None:
            signal.signal(sig, handler)


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
