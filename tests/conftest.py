"""Shared fixtures: tiny random targets saved by transformers (the oracle) and loaded by dspine. The builders
they call, and every other helper shared between test files, live in tests/helpers.py."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch
from helpers import save_tiny_engine_pair, save_tiny_hf, save_tiny_qwen35

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_cuda() -> bool:
    return torch.cuda.is_available()


_CRASH_FD: int | None = None


def pytest_configure(config):
    """Keep a copy of the real stderr: during a test fd 2 is pytest's capture file, lost when the process dies."""
    global _CRASH_FD
    _CRASH_FD = os.dup(2)


@pytest.fixture(autouse=True)
def _crash_trace():
    """A crash prints every thread's Python stack where CI shows it. Why again before each test: importing xgrammar
    (tvm_ffi) replaces the SIGSEGV handler with its own, which writes to fd 2 — the capture file — so a segfault
    in the suite read as a bare "Segmentation fault" with no trace (CI, stop 47)."""
    if _CRASH_FD is not None:
        faulthandler.disable()  # enable() alone keeps whatever handler replaced its own
        faulthandler.enable(file=_CRASH_FD, all_threads=True)
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_verdicts(tmp_path_factory):
    """The session's children on the scripted engine share xgrammar's verdicts on the structures they meet
    (``tests/scripted_cli.py``'s ``remember_verdicts``): a staged job's child then starts in ~1.2 s, not ~4 s,
    and the one-path matrix starts hundreds of them."""
    os.environ["DSPINE_TEST_VERDICTS"] = str(tmp_path_factory.mktemp("verdicts"))
    yield
    os.environ.pop("DSPINE_TEST_VERDICTS", None)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llama_target(llama_dir):
    from dspine import load_target

    return load_target(llama_dir)


@pytest.fixture(scope="session")
def qwen3_target(qwen3_dir):
    from dspine import load_target

    return load_target(qwen3_dir)


@pytest.fixture(scope="session")
def hybrid_target(tmp_path_factory):
    """A tiny Qwen3.5-style hybrid (GDN, full, GDN, full) target."""
    from dspine import load_target

    return load_target(save_tiny_qwen35(tmp_path_factory.mktemp("hybrid")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama target with a tokenizer, and a random DSpine draft for it: ``(model_dir, draft_dir)``.
    (tests/sglang_plugin/test_sglang_plugin.py has its own ``tiny``, which overrides this one there.)"""
    return save_tiny_engine_pair(tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("tiny_draft"))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: decode-sized ops on a shared 2-core box lose 10-20x to OpenMP spin-waits otherwise."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def small_vocab_target(tmp_path_factory):
    """A 16-token Qwen3 with a sharp head: exact laws over a few tokens can be enumerated (χ² tests)."""
    from dspine import load_target

    return load_target(save_tiny_hf(tmp_path_factory.mktemp("v16"), "qwen3", vocab=16, layers=2, head_scale=6.0))
