"""What the DSPINE worker knows of its rounds without waiting for the device: each request's committed tail on the
device, and host copies of a round's facts read only once SGLang has them on the host anyway.

Why (docs/design.md, "The CPU test path"): under SGLang's overlap scheduler the worker's forward for round N+1 runs on
the host while the device still computes round N, and ``req.output_ids`` lacks round N's tokens until the scheduler
processes N's result, after N+1 is launched. A device->host read inside the forward (``.tolist()``, ``.item()``, a
copy from pageable memory) waits for every queued kernel, N+1's draft included, and throws that overlap away.
So:

* ``Tails`` keeps, per request slot (``req_pool_idx``), the tokens the last round committed, on the device
  (a scatter at the end of every forward). With ``len(req.output_ids)`` from the host and the committed length
  from the device (``seq_lens``), device code knows which of them the host has not seen yet: the suffix proposals
  align on them, and rows that need their history on the host (penalties) read it from there.
* ``Deferred`` queues a round's small device facts (which rows verified a suffix match, the draft's block for the
  proposal log) as non-blocking copies into pinned host memory; they are read in ``on_verify_complete_cpu``, the
  hook SGLang calls once it has the round's accept lengths on the host (its own copy, after its own wait), in the
  order the rounds ran, so reading them waits for nothing.
* ``to_device`` is the one host->device copy the worker makes (pinned, non-blocking).
* ``SyncCounter`` (test aid, ``DSPINE_SGLANG_SYNC_LOG``): counts device->host reads made from dspine's code inside a
  forward, per round, with the rows that needed one; how the tests check "no host sync unless a row needs one"
  (a CPU has no device to wait for, so the reads themselves are counted).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

SYNC_LOG_ENV = "DSPINE_SGLANG_SYNC_LOG"


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device (pinned memory, non-blocking copy)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class Tails:
    """The tokens each request slot's last round committed (``[slots, width]`` and their count), on the device."""

    def __init__(self, slots: int, width: int, device):
        self.tokens = torch.zeros((int(slots), int(width)), dtype=torch.int64, device=device)
        self.lens = torch.zeros(int(slots), dtype=torch.int64, device=device)

    def record(self, pool_idx: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """A round's commits: ``tokens [bs, <= width]`` (the first ``lens[b]`` of row b count)."""
        if pool_idx.numel() == 0:
            return
        idx = pool_idx.to(torch.int64)
        n = tokens.shape[1]
        self.tokens[idx, :n] = tokens.to(torch.int64)
        self.lens[idx] = lens.to(torch.int64)

    def of(self, pool_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = pool_idx.to(torch.int64)
        return self.tokens[idx], self.lens[idx]


def unseen_tokens(committed: torch.Tensor, known: torch.Tensor, tail: torch.Tensor, tail_len: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(m [bs], ok [bs]): how many committed tokens the host has not seen (``committed - known``) and whether they
    are the last ``m`` of the row's recorded tail (always, unless the host lags more than one round)."""
    m = committed.to(torch.int64) - known.to(torch.int64)
    return m, (m >= 0) & (m <= tail_len)


def history(output_ids, committed: int, tail: list[int], tail_len: int) -> tuple[list[int], bool]:
    """A row's generated tokens (every committed one, the anchor last) on the host: what ``output_ids`` shows,
    completed from the device tail (``output_ids`` lags a round under overlap scheduling), cut where it runs ahead
    (a request the scheduler has not settled yet). ``False`` when the tail cannot cover the gap."""
    known = len(output_ids)
    if known >= committed:
        return [int(t) for t in output_ids[:committed]], True
    m = committed - known
    if m > tail_len:
        return [int(t) for t in output_ids], False
    return [int(t) for t in output_ids] + [int(t) for t in tail[tail_len - m : tail_len]], True


def settled(req: Any) -> bool:
    """Whether SGLang keeps this round's tokens of ``req``: not for a row already finished or retracted (under
    overlap scheduling such a row runs one more round, whose result SGLang drops and does not count)."""
    return not (req.finished() or getattr(req, "is_retracted", False))


@dataclass
class Record:
    """One verify round's facts for the host, queued until SGLang's ``on_verify_complete_cpu`` for that round."""

    reqs: list[Any]
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # pinned copies (read after ``event``)
    path: str | None = None  # which draft branch proposed: "graph" (the captured sampler) or "eager"
    event: Any = None

    def read(self, name: str) -> list | None:
        t = self.host.get(name)
        if t is None:
            return None
        if self.event is not None:
            self.event.synchronize()  # already done: SGLang waited for this round's results before calling us
        return t.tolist()


class Deferred:
    """FIFO of ``Record``: SGLang processes verify results in the order the rounds ran (both scheduler loops)."""

    def __init__(self) -> None:
        self.queue: deque[Record] = deque()

    def push(self, reqs: list[Any], tensors: dict[str, torch.Tensor], path: str | None = None) -> Record:
        rec = Record(list(reqs), {k: _pinned_copy(v) for k, v in tensors.items()}, path)
        dev = next((v.device for v in tensors.values()), None)
        if dev is not None and dev.type == "cuda":
            rec.event = torch.cuda.Event()
            rec.event.record()
        self.queue.append(rec)
        return rec

    def pop(self, batch_size: int) -> Record | None:
        """This round's record, or None (a round that queued nothing; one that disagrees is dropped)."""
        while self.queue:
            rec = self.queue.popleft()
            if len(rec.reqs) == batch_size:
                return rec
        return None


class SyncCounter:
    """Test aid: counts ``Tensor`` reads to the host made by dspine's code (not the CPU path's stand-ins for SGLang's
    CUDA kernels) while a DSPINE forward runs in this thread,
    one JSON line per forward: ``{"mode": "decode"|"extend", "syncs": n, "needs": rows that needed one}``; on a GPU
    also ``"cuda_syncs"``, every synchronising CUDA call of the forward from any code (SGLang's included), from
    ``torch.cuda.set_sync_debug_mode`` (the first-GPU checklist's profile of a round)."""

    READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, path: str):
        self.path = path
        self.local = threading.local()
        self.root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dspine package
        # the CPU path's torch stand-ins for SGLang's CUDA kernels are SGLang's side of the round, not ours
        here = os.path.dirname(os.path.abspath(__file__))
        self.stand_ins = tuple(os.path.join(here, f) for f in ("cpu_kernels.py", "cpu.py", "stand_in"))
        for name in self.READS:
            self._wrap(name)

    @classmethod
    def from_env(cls) -> SyncCounter | None:
        path = os.environ.get(SYNC_LOG_ENV)
        return cls(path) if path else None

    def _wrap(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        counter = self

        def read(self, *args, **kwargs):
            n = getattr(counter.local, "count", None)
            if n is not None:
                code = sys._getframe(1).f_code
                if code.co_filename.startswith(counter.root) and not code.co_filename.startswith(counter.stand_ins):
                    counter.local.count = n + 1
                    where = f"{os.path.relpath(code.co_filename, counter.root)}:{sys._getframe(1).f_lineno} {name}"
                    if where not in counter.local.where:
                        counter.local.where.append(where)
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    def start(self) -> None:
        self.local.count = 0
        self.local.needs = 0
        self.local.where = []
        self.local.fallbacks = 0
        if torch.cuda.is_available():
            catcher = warnings.catch_warnings(record=True)
            self.local.cuda = (catcher, catcher.__enter__())
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def need(self, rows: int) -> None:
        self.local.needs = getattr(self.local, "needs", 0) + int(rows)

    def fell_back(self) -> None:
        """A row's history could not be rebuilt exactly (``rounds.history`` said so): recorded as ``fallbacks``."""
        self.local.fallbacks = getattr(self.local, "fallbacks", 0) + 1

    def stop(self, mode: str) -> None:
        n, self.local.count = self.local.count, None
        rec = {"mode": mode, "syncs": n, "needs": self.local.needs, "fallbacks": self.local.fallbacks}
        if n:
            rec["where"] = self.local.where[:8]
        cuda, self.local.cuda = getattr(self.local, "cuda", None), None
        if cuda is not None:
            torch.cuda.set_sync_debug_mode("default")
            catcher, seen = cuda
            catcher.__exit__(None, None, None)
            rec["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in seen)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
