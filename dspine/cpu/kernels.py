"""Our CPU kernels (``dspine/cpu/csrc/``), built on first use for this machine's instruction set and cached.

Why our own (docs/design.md, "The CPU step"): on the 2-core machines this project runs on, torch's fp32
linear (MKL) moves 5-10 GB/s on decode shapes (1-32 rows against ~200 small weight matrices per step) while
the weights could stream at 20-40 GB/s, and a 4-row verify costs ~2x a 1-row step where it could cost about
the same. ``csrc/linear.cpp`` repacks each weight once and streams it once per forward for any small number
of rows; it is also batch invariant (a row's outputs do not depend on the other rows), which torch's kernels
are not. ``csrc/ops.cpp`` fuses the chains of tiny ops around them (RMSNorm, RoPE + KV store, attention over
the cache, SiLU gate), which are most of what remains of a decode step once the linears are fast; ``csrc/layer.cpp``
runs a whole dense pre-norm layer as one call of those kernels (``llama.Block.plan_fused``). Where the CPU has AMX
tiles the bf16 family of linears runs on them (``csrc/amx_bf16.h``, ``set_bf16_amx``; ``DSPINE_AMX=0``: never).

The build is a JIT C++ extension (``torch.utils.cpp_extension``: a C++ compiler and ninja), once per machine
kind, under ``$DSPINE_CACHE_DIR/kernels`` (default ``~/.cache/dspine/kernels``) in a folder named by the content of
the sources, the instruction set, the compiler flags, torch and Python (``build_key``) — never by the sources' paths,
so checkouts and virtualenvs share one build. One process builds while the others wait (``disk_cache.exclusive``: an
flock its holder's death releases, so a build killed half-way never blocks the next run); it compiles copies of the
sources inside a temporary folder and publishes the folder with one rename, so a build in the cache is complete and
is loaded as it is (``torch.ops.load_library``: no compiler, no ninja, no torch lock). Every build says why on stderr.
The instruction set is chosen from ``/proc/cpuinfo`` and passed as explicit flags, never ``-march=native``,
so a build made on one node runs on every node with the same ISA. Where the build cannot run (no compiler),
or with ``DSPINE_KERNELS=0``, everything falls back to torch with a one-line warning; which one ran is part
of the engine's identity (``kernel_name``), since it changes fp32 rounding.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspine.cpu.disk_cache import atomic_file, cache_root, exclusive, publish_dir, remove_temps, say, temp_sibling
from dspine.cpu.precision import cpu_flags

ENV = "DSPINE_KERNELS"  # "0"/"off"/"torch": never build or use them; "avx2"/"generic": that build (tests)
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("linear.cpp", "gemm_bf16.cpp", "gemm_q8.cpp", "attention_bf16.cpp", "ops.cpp",
                                    "layer.cpp")]
HEADERS = [CSRC / name for name in ("vec.h", "sched.h", "attend_items.h", "amx_bf16.h", "team.h")]
AMX_ENV = "DSPINE_AMX"  # "0"/"off": the bf16 family on AVX512-BF16 even where the CPU has AMX tiles
QK = 32  # GGUF block length
FORMATS = ("q4_1", "q8_0", "bf16", "f32")  # tried in this order: the first that holds the weight exactly
# The bf16 precision policy's format (never tried by default: it rounds): weights rounded to bfloat16, inputs
# rounded on entry, fp32 sums, through AVX512-BF16 tiles (``csrc/gemm_bf16.cpp``); only where ``bf16dp_ok()``.
BF16DP = "bf16dp"
# The same policy over GGUF blocks (``csrc/gemm_bf16.cpp``): a weight that is exactly Q4_1/Q8_0 blocks stays blocks
# (0.75 / 1.125 bytes a weight instead of bf16's 2) and is expanded and rounded to bf16 per panel as it is used, with
# the bits of ``BF16DP`` for any row count. Why: decode streams every weight once per step, and the weights' memory
# (BENCHMARKS.md, "bf16 KV cache and bf16 decode": measured, it is not what makes 1-row bf16 steps slower than fp32).
BF16DP_Q4_1, BF16DP_Q8_0 = "bf16dp_q4_1", "bf16dp_q8_0"
BF16_FORMATS = (BF16DP_Q4_1, BF16DP_Q8_0, BF16DP)  # what the bf16 policy tries, in this order
# The integer policies' formats (``csrc/gemm_q8.cpp``): a weight that is exactly Q4_1/Q8_0 blocks stays blocks (0.625 /
# 1.0625 bytes a weight: GGUF's float16 scales) and multiplies input rows quantised per block of 32 on integer dot
# products (AVX512-VNNI, AVX2 or portable: the same bits), int32 sums, the scales applied once per block. ``q8``
# (``quant=q8``): one int8 part per input, as llama.cpp does; ``q16`` (``quant=q16``): two int8 parts (the input to
# ~16 bits: x = d (q + q2 / 256)), twice the products, a hundredth of q8's error. They round the inputs, so each is a
# policy of its own (``-q8`` / ``-q16`` in the kernel name). A weight on no grid takes the bf16 family where it runs,
# else the exact fp32 formats.
Q8DP_Q4_1, Q8DP_Q8_0 = "q8dp_q4_1", "q8dp_q8_0"
Q16DP_Q4_1, Q16DP_Q8_0 = "q16dp_q4_1", "q16dp_q8_0"
INT_FORMATS = {"q8": (Q8DP_Q4_1, Q8DP_Q8_0), "q16": (Q16DP_Q4_1, Q16DP_Q8_0)}  # per policy, in the order tried
ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}

_state: dict[str, object] = {}


def cpu_isa(flags: set[str] | None = None) -> str:
    """The kernel build for this CPU: ``avx512``, ``avx2`` or ``generic``."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def wanted_isa(env: dict[str, str] | None = None, flags: set[str] | None = None) -> str:
    """``cpu_isa()``, or a lower build named by ``DSPINE_KERNELS`` (to test the AVX2/portable code on any CPU)."""
    env = os.environ if env is None else env
    best = cpu_isa(flags)
    order = list(ISA_CFLAGS)  # best first
    asked = env.get(ENV, "").strip().lower()
    if asked in ISA_CFLAGS and order.index(asked) >= order.index(best):
        return asked
    return best


def disabled(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV, "").strip().lower() in ("0", "off", "torch", "false", "no")


def cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", *ISA_CFLAGS[isa]]


def sources_digest() -> str:
    """The content of every kernel source and header (never their paths, so two checkouts or virtualenvs agree): what
    a build is named by, and what the cost model's calibrations are keyed by (``dspine/decoding/cost.py``)."""
    digest = hashlib.sha256()
    for p in SOURCES + HEADERS:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_key(isa: str) -> dict[str, str]:
    """Everything a build's machine code depends on: the sources' content (``sources_digest``), the instruction set,
    the compiler flags, torch and Python."""
    return {"isa": isa, "sources": sources_digest(), "cflags": " ".join(cflags(isa)), "torch": torch.__version__,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}


def build_name(isa: str) -> str:
    """The build's folder (and library) name: content-addressed by ``build_key``."""
    key = build_key(isa)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    torch_tag = torch.__version__.split("+")[0].replace(".", "_")
    return f"dspine_cpu_{isa}_t{torch_tag}_py{sys.version_info[0]}{sys.version_info[1]}_{digest}"


def load() -> str | None:
    """Build (first time) and load the kernels; the ISA name when they are usable here, else None.

    Never raises: a failed build is reported once on stderr and torch is used from then on.
    """
    if "isa" in _state:
        return _state["isa"]  # type: ignore[return-value]
    isa: str | None = None
    if disabled():
        _state["why"] = f"{ENV}={os.environ.get(ENV)}"
    else:
        isa = _build(wanted_isa())
    _state["isa"] = isa
    if isa is not None:
        set_bf16_amx(os.environ.get(AMX_ENV, "").strip().lower() not in ("0", "off", "false", "no"))
    return isa


@contextlib.contextmanager
def _ninja_on_path():
    """PATH with a ``ninja`` on it, for the build: torch runs ``ninja`` from PATH, and the ``ninja`` pip package
    (our dependency) installs it beside this interpreter, which is not on PATH when a virtualenv's python runs
    without activating the venv (``scripts/ci/ci_sglang.sh`` runs it so)."""
    old = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        dirs = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
        with contextlib.suppress(Exception):
            import ninja

            dirs.insert(0, ninja.BIN_DIR)
        found = next((d for d in dirs if d and shutil.which("ninja", path=d)), None)
        if found:
            os.environ["PATH"] = found if not old else found + os.pathsep + old
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _build(isa: str) -> str | None:
    """Load the published build for this key, building it first (one process at a time) when there is none."""
    try:
        name = build_name(isa)
        root = cache_root() / "kernels"
        so = root / name / f"{name}.so"
        broken = None
        if so.is_file():  # published builds are complete (atomic rename): load, no compiler, no lock
            try:
                torch.ops.load_library(str(so))
            except OSError as e:  # damaged on disk (a copy gone wrong, a full disk long ago): build it again
                broken = " ".join(str(e).split())[:200]
        if broken is not None or not so.is_file():
            _build_locked(isa, name, root, broken)
        return str(torch.ops.dspine_cpu.isa())
    except Exception as e:  # no compiler / ninja, a read-only cache, a broken toolchain: torch still works
        text = str(e)
        errors = [ln.strip() for ln in text.splitlines() if "error" in ln.lower() and "Error building" not in ln]
        why = " ".join((errors[0] if errors else text).split())[:300]
        _state["why"] = why
        say(f"warning: CPU kernels unavailable, using torch's ({why})")
        return None


def _build_locked(isa: str, name: str, root: Path, broken: str | None = None) -> None:
    """Under ``root/<name>.lock``: build into a temporary folder holding copies of the sources, then publish it as
    ``root/<name>`` in one rename; a process that waited for another's build loads that one. Loads the library.
    ``broken``: why the published build did not load (it is replaced, unless another process already did)."""
    from torch.utils import cpp_extension

    final = root / name
    seen = _stamp(final / f"{name}.so")
    with exclusive(root / f"{name}.lock", f"building the CPU kernels for {isa}") as held:
        so = final / f"{name}.so"
        if so.is_file() and (broken is None or _stamp(so) != seen):  # built by the process we waited for
            if held.waited_for:
                say(f"CPU kernels built by {held.waited_for.describe()} are ready (waited {held.waited_s:.0f} s)")
            torch.ops.load_library(str(so))
            return
        remove_temps(final)  # what a killed builder left (nobody else builds this key while we hold the lock)
        why = f"the cached build does not load: {broken}" if broken else _why_build(root, name, isa, held)
        say(f"building the CPU kernels for {isa} ({why}; ~40 s, once per machine kind) in {final}")
        tmp = temp_sibling(final)
        src = tmp / "src"
        src.mkdir(parents=True)
        for p in SOURCES + HEADERS:  # compiled from here: the paths a build records are the same everywhere
            shutil.copyfile(p, src / p.name)
        (tmp / KEY_FILE).write_text(json.dumps(build_key(isa) | {"built_by": socket.gethostname(),
                                                                 "built_at": time.time()}, indent=1) + "\n")
        t0 = time.monotonic()
        try:
            with _ninja_on_path():
                cpp_extension.load(name=name, sources=[str(src / p.name) for p in SOURCES],
                                   build_directory=str(tmp), is_python_module=False, extra_cflags=cflags(isa),
                                   verbose=False)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"built the CPU kernels for {isa} in {time.monotonic() - t0:.0f} s")


KEY_FILE = "build.json"


def _stamp(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of a file, to tell a rebuilt library from the one that failed; None when absent."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _why_build(root: Path, name: str, isa: str, held: Any) -> str:
    """Why this build runs, in a few words: a build that died, an empty cache, or what differs from the newest
    build of the same instruction set (sources, torch, compiler flags, Python)."""
    if held.died is not None:
        return (f"the build by {held.died.describe()} did not finish: it was killed or crashed "
                f"{max(0.0, time.time() - held.died.since):.0f} s after it started")
    key = build_key(isa)
    others = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            with contextlib.suppress(OSError, ValueError):
                if entry.name != name and entry.is_dir():
                    others.append(json.loads((entry / KEY_FILE).read_text()))
    same = sorted((o for o in others if o.get("isa") == isa), key=lambda o: o.get("built_at", 0))
    if not same:
        return f"no {isa} build in this cache yet" + (" (it has builds for other CPUs)" if others else "")
    last = same[-1]
    changed = [f"{k} {last.get(k)} -> {key[k]}" if k in ("torch", "python") else
               ("the sources changed" if k == "sources" else f"compiler flags changed ({key[k]})")
               for k in ("sources", "torch", "cflags", "python") if last.get(k) != key[k]]
    return "; ".join(changed) or "the cached build is incomplete"


def bf16dp_ok() -> bool:
    """True where the bf16 family of linears runs: the avx512 build on a CPU with AVX512-BF16."""
    return load() == "avx512" and "avx512_bf16" in cpu_flags() and bool(torch.ops.dspine_cpu.has_bf16dp())


def set_bf16_amx(want: bool) -> bool:
    """Run the bf16 family of linears on AMX tiles (``csrc/amx_bf16.h``) where the CPU has them and Linux grants them
    to this process, else on AVX512-BF16 (``csrc/gemm_bf16.cpp``); True when AMX runs. ``load()`` chooses once
    (``DSPINE_AMX=0``: never). The two give different bits (another summation order), so a target records which in
    its kernel name when it is built (``bf16_isa``): tests switch it only around targets they build themselves."""
    _state["amx"] = bool(torch.ops.dspine_cpu.bf16_amx(bool(want)))
    return _state["amx"]  # type: ignore[return-value]


def set_team_stack(want: bool) -> bool:
    """Run a covered forward's layers in one parallel region over buffers allocated once (``csrc/layer.cpp``'s team
    stack, the default) or as the loop of fused layer calls (``False``: for the tests' and benchmarks' comparisons).
    Same bits either way. Returns the setting."""
    if load() is None:
        return False
    return bool(torch.ops.dspine_cpu.team_stack(bool(want)))


def bf16_isa() -> str:
    """The instruction set of the bf16 family as a target's kernel name says it: ``avx512+amx`` or ``avx512``."""
    isa = load()
    return f"{isa}+amx" if isa and _state.get("amx") else str(isa)


BF16_ATTENTION_DIMS = (32, 64, 128)


@functools.cache
def _bf16dp_for(isa: str | None) -> bool:
    return isa is not None and bf16dp_ok()


def bf16_attention(head_dim: int) -> bool:
    """Whether attention over a bf16 KV cache runs on bf16 dot products (``csrc/attention_bf16.cpp``): where the
    bf16 family runs and ``head_dim`` is one it has tiles for. Cached: it is asked once per layer and step."""
    return head_dim in BF16_ATTENTION_DIMS and _bf16dp_for(load())


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (after it ran), else None."""
    return _state.get("why")  # type: ignore[return-value]


def kernel_name() -> str:
    """What computes the fp32 linears: ``dspine-avx512`` / ``dspine-avx2`` / ``dspine-generic`` or ``torch``."""
    isa = load()
    return f"dspine-{isa}" if isa else "torch"


def _fp16_grid(estimate: torch.Tensor, step: int) -> torch.Tensor:
    """The float16 value ``step`` representable numbers away from ``estimate`` rounded to float16 (>= 0), as fp32."""
    bits = estimate.clamp(min=0).half().view(torch.int16).int() + step
    return bits.clamp(0, 0x7BFF).short().view(torch.float16).float()


_PROBE_BLOCKS = 256  # blocks searched first: a weight on no grid (a bf16 draft's) fails there, not after all of it


def _search(blocks: torch.Tensor, estimate: torch.Tensor, decode) -> torch.Tensor | None:
    """Per block, the first float16 scale near ``estimate`` for which ``decode(scale)`` -> (q, values) gives
    back the block's values exactly; None when some block has none (not a quantized weight).

    The first ``_PROBE_BLOCKS`` blocks are searched alone first: every block must pass, so a weight whose first
    blocks fail is refused without searching the rest (same answer; packing a bf16 draft went from seconds to
    milliseconds)."""
    flat_b, flat_e = blocks.reshape(-1, QK), estimate.reshape(-1)
    if flat_e.numel() > 2 * _PROBE_BLOCKS and _search_some(flat_b, flat_e, decode, _PROBE_BLOCKS) is None:
        return None
    scale = _search_some(flat_b, flat_e, decode, flat_e.numel())
    return None if scale is None else scale.view_as(estimate)


def _search_some(flat_b: torch.Tensor, flat_e: torch.Tensor, decode, n: int) -> torch.Tensor | None:
    """``_search`` over the first ``n`` blocks (the others' scales stay NaN)."""
    scale = torch.full_like(flat_e, float("nan"))
    todo = torch.arange(n, device=flat_e.device)
    for step in (0, -1, 1, -2, 2, -3, 3):
        d = _fp16_grid(flat_e[todo], step)
        _, values = decode(flat_b[todo], d, todo)
        ok = (values == flat_b[todo]).all(-1)
        scale[todo[ok]] = d[ok]
        todo = todo[~ok]
        if todo.numel() == 0:
            return scale
    return None


_CHUNK_ELEMS = 1 << 23  # values searched at a time (32 MB of fp32): the search's temporaries are a few fp32 copies
# of what it looks at; smaller chunks cost per-op overhead (1,024 rows of the 49k head: 2.5x slower)


def _chunk_rows(weight: torch.Tensor) -> int:
    return max(1, _CHUNK_ELEMS // max(1, weight.shape[1]))


def _by_rows(find, weight: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``find`` (``exact_q4_1`` / ``exact_q8_0``) over ``_chunk_rows`` rows at a time, the parts concatenated (its
    outputs are all row-major); None as soon as one part is. The same answer as one search over the whole weight,
    with temporaries bounded by a chunk's size instead of a few copies of the weight (a 49k-row head: ~600 MB)."""
    parts, rows = [], _chunk_rows(weight)
    for i in range(0, weight.shape[0], rows):
        part = find(weight[i:i + rows])
        if part is None:
            return None
        parts.append(part)
    return tuple(torch.cat(xs) for xs in zip(*parts))


def exact_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """W [N, K] whose every block of 32 columns is ``d * q + m`` (q in 0..15, d and m float16), as GGUF Q4_1
    stores it -> (q bytes [N, K/32, 16] in GGUF order, d [N, K/32], m [N, K/32]); None if W is not such a weight.

    Q4_1 sets m to the block's minimum and d to (max - min) / 15, so min(W) = m and the scale is float16 within
    a few steps of (max(W) - m) / 15; each candidate is checked by rebuilding the block in fp32 (d * q is exact
    there, so the kernel's fused multiply-add gives the same values).
    """
    n, k = weight.shape
    if k % QK or weight.dtype != torch.float32:
        return None
    if n > _chunk_rows(weight):
        return _by_rows(exact_q4_1, weight)  # type: ignore[return-value]
    blocks = weight.detach().reshape(n, k // QK, QK)
    m = blocks.amin(-1)
    if not torch.equal(m.half().float(), m):
        return None
    flat_m = m.reshape(-1)

    def decode(b, d, idx):
        mm = flat_m[idx][:, None]
        q = torch.where(d[:, None] > 0, (b - mm) / d[:, None], torch.zeros_like(b)).round().clamp(0, 15)
        return q, d[:, None] * q + mm

    d = _search(blocks, (blocks.amax(-1) - m) / 15, decode)
    if d is None:
        return None
    q, _ = decode(blocks.reshape(-1, QK), d.reshape(-1), torch.arange(d.numel()))
    q = q.to(torch.uint8).reshape(n, k // QK, QK)
    return (q[..., :16] | (q[..., 16:] << 4)).contiguous(), d, m


def exact_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """W [N, K] whose every block of 32 columns is ``d * q`` (q in -128..127, d float16), as GGUF Q8_0 stores
    it -> (q [N, K/32, 32] int8, d [N, K/32]); None if W is not such a weight."""
    n, k = weight.shape
    if k % QK or weight.dtype != torch.float32:
        return None
    if n > _chunk_rows(weight):
        return _by_rows(exact_q8_0, weight)  # type: ignore[return-value]
    blocks = weight.detach().reshape(n, k // QK, QK)

    def decode(b, d, idx):
        q = torch.where(d[:, None] > 0, b / d[:, None], torch.zeros_like(b)).round().clamp(-128, 127)
        return q, d[:, None] * q

    d = _search(blocks, blocks.abs().amax(-1) / 127, decode)
    if d is None:
        return None
    q, _ = decode(blocks.reshape(-1, QK), d.reshape(-1), torch.arange(d.numel()))
    return q.to(torch.int8).reshape(n, k // QK, QK), d


# each format's op (and its ``parts`` argument, 0: the op has none)
OP_NAMES = {"f32": ("linear", 0), "q4_1": ("linear_q4_1", 0), "q8_0": ("linear_q8_0", 0), "bf16": ("linear_bf16", 0),
            BF16DP: ("linear_bf16dp", 0), BF16DP_Q4_1: ("linear_bf16dp_q4_1", 0),
            BF16DP_Q8_0: ("linear_bf16dp_q8_0", 0), Q8DP_Q4_1: ("linear_q8dp_q4_1", 1),
            Q8DP_Q8_0: ("linear_q8dp_q8_0", 1), Q16DP_Q4_1: ("linear_q8dp_q4_1", 2),
            Q16DP_Q8_0: ("linear_q8dp_q8_0", 2)}


class PackedLinear(nn.Module):
    """Inference-only ``nn.Linear`` replacement whose weight is repacked for ``csrc/linear.cpp``.

    The weight is stored in the most compact of ``formats`` that holds it *exactly* (Q4_1 or Q8_0 blocks
    where the fp32 values are such blocks' values, as in a model converted from a GGUF; bfloat16 where every
    value is one, as in a draft trained and saved in bf16; fp32 otherwise), so
    the outputs are the fp32 weight's whatever the format. The packed copy is the only one (no ``weight``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 formats: tuple[str, ...] | None = None):
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("PackedLinear needs a float32 CPU weight")
        if load() is None:
            raise RuntimeError(f"dspine CPU kernels unavailable: {unavailable_reason()}")
        self.out_features, self.in_features = weight.shape
        w = weight.detach()
        self.format, packed = "f32", None
        for fmt in FORMATS if formats is None else formats:
            if fmt == "q4_1" and (blocks := exact_q4_1(w)) is not None:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_q4_1(*blocks)
            elif fmt == "q8_0" and (blocks := exact_q8_0(w)) is not None:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_q8_0(*blocks)
            elif fmt == "bf16" and torch.equal((half := w.bfloat16()).float(), w):
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_bf16(half)
            elif fmt.startswith(BF16DP) and not bf16dp_ok():
                raise RuntimeError(f"the {fmt} format needs a CPU with AVX512-BF16 and the avx512 kernel build")
            elif fmt == BF16DP_Q4_1 and (blocks := exact_q4_1(w)) is not None:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_bf16dp_q4_1(*blocks)
            elif fmt == BF16DP_Q8_0 and (blocks := exact_q8_0(w)) is not None:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_bf16dp_q8_0(*blocks)
            elif fmt == BF16DP:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_bf16dp(w.bfloat16())
            elif fmt in (Q8DP_Q4_1, Q16DP_Q4_1) and (blocks := exact_q4_1(w)) is not None:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_q8dp_q4_1(*blocks)
            elif fmt in (Q8DP_Q8_0, Q16DP_Q8_0) and (blocks := exact_q8_0(w)) is not None:
                self.format, packed = fmt, torch.ops.dspine_cpu.pack_q8dp_q8_0(*blocks)
            if packed is not None:
                break
        if packed is None:
            packed = torch.ops.dspine_cpu.pack_linear(w)
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._op = self._ops()[self.format]

    @classmethod
    def from_packed(cls, packed: torch.Tensor, fmt: str, out_features: int, in_features: int,
                    bias: torch.Tensor | None) -> PackedLinear:
        """Rebuild from a packed buffer (``pack_cache``) without looking at the float weight again."""
        if load() is None:
            raise RuntimeError(f"dspine CPU kernels unavailable: {unavailable_reason()}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features, self.format = out_features, in_features, fmt
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)
        self._op = cls._ops()[fmt]
        return self

    @staticmethod
    def _ops() -> dict:
        return {fmt: functools.partial(getattr(torch.ops.dspine_cpu, name), parts=parts) if parts else
                getattr(torch.ops.dspine_cpu, name) for fmt, (name, parts) in OP_NAMES.items()}

    def op_spec(self) -> tuple[str, int]:
        """(the op's qualified name, its ``parts`` argument or 0): how ``csrc/layer.cpp`` calls this linear."""
        name, parts = OP_NAMES[self.format]
        return f"dspine_cpu::{name}", parts

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        y = self._op(flat, self.packed, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def weight_formats(module: nn.Module) -> dict[str, int]:
    """How many ``PackedLinear`` under ``module`` hold their weight in each format (for the run's manifest)."""
    counts: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, PackedLinear):
            counts[m.format] = counts.get(m.format, 0) + 1
    return dict(sorted(counts.items()))


def pack_linears(module: nn.Module, formats: tuple[str, ...] | None = None) -> int:
    """Replace every float32 CPU ``nn.Linear`` under ``module`` by a ``PackedLinear``, in place; how many.

    Call ``load()`` first (this does not fall back by itself).
    """
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if isinstance(child, nn.Linear) and w.dtype == torch.float32 and w.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias, formats))
                count += 1
    return count


class FusedRMSNorm(nn.Module):
    """Inference-only ``dspine.models.layers.RMSNorm`` in one call (fp32); shares the original's weight."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps, self.offset = float(norm.eps), float(norm.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return _rms_norm_torch(x, self.weight, self.eps, self.offset)
        return torch.ops.dspine_cpu.rms_norm(x, self.weight, self.eps, self.offset)


def _rms_norm_torch(x, weight, eps, offset):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (offset + weight.float())).to(dtype)


def rope_store(q, k, v, cos, sin, kc, vc, pos):
    """RoPE on q [B, T, Hq, D] (in place) and k; k and v stored into the caches [B, Hkv, cap, D] at pos [B, T];
    cos/sin [B, T, rotary_dim]. Returns q. The caches are float32 or bfloat16: k is rotated in fp32 and, for a bf16
    cache, rounded (nearest even, torch's ``.bfloat16()``) as it is stored."""
    return torch.ops.dspine_cpu.rope_store(q, k, v, cos, sin, kc, vc, pos)


def attend_cache(q, kc, vc, pos, window: int | None, scale: float) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] at positions pos [B, T] over the caches (slots <= pos, within ``window``)
    -> [B, T, Hq * D]. float32 caches: fp32 arithmetic (``csrc/ops.cpp``). bfloat16 caches (the bf16 policy):
    bf16 dot products where ``bf16_attention(D)`` (the query as two bf16 parts, softmax weights rounded to bf16,
    fp32 sums: ``csrc/attention_bf16.cpp``), elsewhere the values loaded into fp32 and the fp32 path's arithmetic
    (the bits of the same cache in fp32). Either way a query's bits depend on its own inputs only."""
    if kc.dtype == torch.bfloat16 and bf16_attention(q.shape[-1]):
        return torch.ops.dspine_cpu.attend_cache_bf16dp(q, kc, vc, pos, int(window or 0), float(scale))
    return torch.ops.dspine_cpu.attend_cache(q, kc, vc, pos, int(window or 0), float(scale))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    return torch.ops.dspine_cpu.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> gelu_tanh(gate) * up [..., I] (Gemma's MLP and per-layer gate). Why ours: torch's
    elementwise GELU computes a tensor's tail (and each thread's) on a scalar path that rounds differently, so a
    token's bits would follow its place in the batch; here each position of a row takes one path."""
    return torch.ops.dspine_cpu.gelu_tanh_mul(gate_up)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the same indices: a row's first NaN, else the first of its maxima), through
    ``csrc/ops.cpp``'s vector passes for 2-D fp32 CPU logits where the kernels are loaded: 6-8x torch's reduction,
    which took ~1 % of a greedy decode step at 8-32 rows (BENCHMARKS.md, issue 53). Anything else goes to torch."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape[1] > 0
            and load() is not None):
        return torch.ops.dspine_cpu.argmax_rows(logits)
    return logits.argmax(-1)


# -- packed weights cached on disk --------------------------------------------------------------------------


def pack_cache_path(key: str) -> Path:
    return cache_root() / "packed" / f"{build_name(load() or 'none')}-{key}.safetensors"


def save_packed(module: nn.Module, path: Path) -> None:
    """Every ``PackedLinear`` under ``module`` (buffers, format, shape) to one safetensors file, atomically; a
    read-only cache is not an error."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, m in module.named_modules():
        if isinstance(m, PackedLinear):
            tensors[f"{name}.packed"] = m.packed.contiguous()
            if m.bias is not None:
                tensors[f"{name}.bias"] = m.bias.contiguous()
            meta[name] = f"{m.format},{m.out_features},{m.in_features}"
    try:
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
    except OSError:
        pass


def load_packed(module: nn.Module, path: Path) -> bool:
    """Replace the float ``nn.Linear`` modules named in ``path`` by their cached ``PackedLinear``; False (and
    nothing changed) when the file is missing, unreadable or does not match the module."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            mods = dict(module.named_modules())
            plan = []
            for name, spec in meta.items():
                fmt, n_out, n_in = spec.split(",")
                lin = mods.get(name)
                if not isinstance(lin, nn.Linear) or lin.weight.shape != (int(n_out), int(n_in)):
                    return False
                bias = f.get_tensor(f"{name}.bias") if f"{name}.bias" in f.keys() else None
                plan.append((name, PackedLinear.from_packed(f.get_tensor(f"{name}.packed"), fmt, int(n_out), int(n_in),
                                                            bias)))
    except Exception:  # missing, damaged (safetensors' own error type), or from another layout: repack
        return False
    for name, packed in plan:
        parent_name, _, child = name.rpartition(".")
        setattr(mods[parent_name] if parent_name else module, child, packed)
    return True
