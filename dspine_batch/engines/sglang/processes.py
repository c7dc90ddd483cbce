"""The processes behind an in-process ``sglang.Engine``: noticing that they died and stopping only them.

* **Death**: SGLang's subprocess watchdog SIGQUITs this process when a scheduler or detokenizer child crashes
  (with our ``custom_sigquit_handler`` that only sets a flag), and a watched child can simply be gone; both
  end the run with ``EngineDied`` (finished rows are committed, a rerun resumes).
* **Shutdown**: ``Engine.shutdown`` calls ``kill_process_tree(os.getpid(), include_parent=False)``, which would
  SIGKILL every descendant of this process; ``scoped_shutdown`` limits it to the processes the engine started.
* **Signals**: SGLang's tokenizer manager installs running-phase SIGTERM/SIGQUIT handlers on its loop;
  ``reclaim_signals`` puts ours back.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

from dspine_batch.errors import EngineDied  # noqa: F401  (re-exported: engine death is the pipeline's exit-75 case)

_SIGQUIT = threading.Event()


def on_sigquit(signum, frame) -> None:  # module level: ServerArgs (with this handler) is pickled to children
    _SIGQUIT.set()


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


def scoped_shutdown(engine: Any, owned: set[int], contexts_before: Any = None) -> None:
    """``engine.shutdown()`` with its ``kill_process_tree(os.getpid(), ...)`` limited to the engine's own
    processes (those that appeared while it started), so other children of this process survive; then the
    engine's ZeroMQ sockets and contexts closed with no linger (``close_sockets``; with ``contexts_before``, what
    ``zmq_contexts()`` returned before the engine started, every context made since too: ``close_contexts``)."""
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
        close_sockets(engine)
        if contexts_before is not None:
            close_contexts(contexts_before)


def close_sockets(engine: Any) -> None:
    """Close the engine's own ZeroMQ sockets (the engine's RPC socket, the tokenizer manager's to the scheduler and
    from the detokenizer) with no linger, and their contexts. ``Engine.shutdown`` leaves them open; when the garbage
    collector later finds a context in a cycle with its still-open sockets, ``Context.__del__`` calls ``term()``,
    which waits for those sockets forever: a process that starts engines one after another (the SGLang tests) hung
    in an unrelated allocation with only the old engine's detokenizer left."""
    try:
        import zmq
    except ImportError:
        return
    holders = [engine, getattr(engine, "tokenizer_manager", None)]
    contexts = []
    for holder in holders:
        for value in list(vars(holder).values()) if holder is not None else ():
            if isinstance(value, zmq.Socket) and not value.closed:
                contexts.append(value.context)
                value.close(linger=0)
    for ctx in contexts:
        if not ctx.closed:
            ctx.destroy(linger=0)


def _live_contexts() -> list[Any]:
    """The ZeroMQ contexts alive in this process (the garbage collector's list; [] without pyzmq). ``type(o)``, not
    ``isinstance``: a proxy's ``__class__`` is never asked (torch's deprecated ``reduce_op`` warns when it is)."""
    try:
        import zmq
    except ImportError:
        return []
    return [o for o in gc.get_objects() if issubclass(type(o), zmq.Context)]


def zmq_contexts() -> Any:
    """The ZeroMQ contexts alive in this process now (a weak set), taken before an engine starts so that
    ``close_contexts`` can tell the engine's from the others."""
    import weakref

    return weakref.WeakSet(_live_contexts())


def close_contexts(before: Any) -> None:
    """Destroy, with no linger, every ZeroMQ context alive now that was not in ``before``: those SGLang made while
    the engine ran. ``close_sockets`` reaches the sockets the engine and its tokenizer manager hold by name; SGLang
    also keeps some in helper objects (a load-snapshot reader, communicators) and makes its contexts as locals, so
    a context in a cycle with an open socket still met the garbage collector later and hung the process in
    ``term()`` (the SGLang test leg, two engines on). Only this process's engine makes contexts between its start
    and its close in dspine-batch; a library user sharing the process with other ZeroMQ users passes no
    ``contexts_before``."""
    for ctx in _live_contexts():
        if ctx not in before and not ctx.closed:
            ctx.destroy(linger=0)


def reclaim_signals(engine: Any, handlers: dict[int, Any], loop: Any = None) -> None:
    """Undo SGLang's running-phase signal handlers in this process.

    On its first request SGLang's tokenizer manager adds event-loop handlers for SIGTERM (drain and exit) and
    SIGQUIT (``kill_process_tree(os.getpid())``: kills this process too). We create that loop now and put back
    our handlers: SIGTERM stays the pipeline's graceful stop, SIGQUIT only marks the engine dead.

    The handle loop must be created *on the loop the requests run on* (``loop``): outside a running loop
    SGLang's ``get_or_create_event_loop`` makes a fresh one, whose output reader then never runs and every
    request waits forever.
    """
    tm = getattr(engine, "tokenizer_manager", None)
    if tm is None or not handlers or not hasattr(tm, "auto_create_handle_loop"):
        return
    if loop is not None:
        async def create() -> None:
            tm.auto_create_handle_loop()

        loop.run_until_complete(create())
    else:
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
