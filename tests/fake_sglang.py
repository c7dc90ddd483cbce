"""A stand-in for ``sglang.Engine`` (no SGLang, no GPU) for the adapter tests: ``async_generate`` on its own
event loop, SGLang-0.5.23-shaped ``meta_info``, scripted aborts/failures, and a ``shutdown`` that, like
SGLang's, calls this module's ``kill_process_tree(os.getpid(), include_parent=False)``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import psutil


def kill_process_tree(parent_pid, include_parent: bool = True, skip_pid=None, wait_timeout=60):
    """What SGLang's does: SIGKILL every descendant of parent_pid (and it, unless include_parent=False)."""
    procs = psutil.Process(parent_pid).children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=wait_timeout)


class FakeTokenizer:
    has_chat_template = False

    def encode(self, text):
        return [ord(c) % 250 + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(96 + i % 26 + 1) for i in ids)

    def eos_ids(self):
        return (0,)

    def token_id(self, s):
        return None

    def render_chat(self, messages):
        return self.encode("".join(m["content"] for m in messages))


class FakeTokenizerManager:
    def __init__(self):
        self.aborted = []

    def abort_request(self, rid="", abort_all=False):
        self.aborted.append(rid)


class FakeEngine:
    def __init__(self, block=4, abort_keys=(), fail_keys=(), hang_keys=(), spawn_child=False, **kwargs):
        self.kwargs = kwargs
        self.block = block
        self.abort_keys, self.fail_keys, self.hang_keys = set(abort_keys), set(fail_keys), set(hang_keys)
        self.loop = asyncio.new_event_loop()
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls = []
        self.tokenizer_manager = FakeTokenizerManager()
        self.shutdown_called = False
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) if spawn_child else None

    async def async_generate(self, input_ids=None, sampling_params=None, rid=None, **kw):
        key = rid.split("#")[0]
        self.calls.append((rid, list(input_ids), dict(sampling_params)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001 * (len(input_ids) % 5))
            if key in self.hang_keys:
                await asyncio.sleep(3600)
            if key in self.fail_keys:
                raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length")
            n = min(sampling_params["max_new_tokens"], 1 + len(input_ids) % 9)
            out = [(sum(input_ids) + i) % 50 + 1 for i in range(n)]
            rounds = max(0, (n - 1 + self.block - 2) // (self.block - 1))
            meta = {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": n, "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": n}, "e2e_latency": 0.01}
            if rounds:
                hist = [0] * self.block
                left = n - 1
                for _ in range(rounds):
                    take = min(left, self.block)
                    hist[take - 1] += 1
                    left -= take
                meta.update(spec_verify_ct=rounds, spec_num_correct_drafts=sum(j * c for j, c in enumerate(hist)),
                            spec_num_proposed_drafts=rounds * (self.block - 1), spec_accept_length=n / rounds,
                            spec_correct_drafts_histogram=hist)
            if kw.get("return_logprob"):  # SGLang's [logprob, token_id, text] entries
                k = int(kw.get("top_logprobs_num") or 0)
                meta["output_token_logprobs"] = [[-0.25 * (i + 1), t, None] for i, t in enumerate(out)]
                meta["output_top_logprobs"] = [[[-0.1 * (j + 1), (t + j) % 50, None] for j in range(k)]
                                               for t in out] if k else [None] * n
            if key in self.abort_keys:
                meta["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue", "status_code": 500}
                out = []
                meta["completion_tokens"] = 0
                for k in [k for k in meta if k.startswith("spec_")]:
                    del meta[k]
            return {"output_ids": out, "meta_info": meta}
        finally:
            self.in_flight -= 1

    def shutdown(self):
        self.shutdown_called = True
        kill_process_tree(os.getpid(), include_parent=False, wait_timeout=30)
