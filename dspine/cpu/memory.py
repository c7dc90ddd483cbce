"""Giving freed memory back to the system.

glibc keeps what a process frees in its heap for later allocations; a start-up that converts and repacks weights
(the draft's bf16 checkpoint into fp32, then into its packed form) or a retired draft leaves ~100 MB there that the
run may never need again, counted in its RSS all along. ``trim`` asks glibc to return it (``malloc_trim``); a no-op
where there is no glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

_LIBC: ctypes.CDLL | None | bool = False  # False: not looked up yet


def trim(collect: bool = True) -> bool:
    """Collect garbage (``collect``), then return the heap's free pages to the system; whether glibc did it."""
    global _LIBC
    if _LIBC is False:
        _LIBC = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _LIBC = lib if hasattr(lib, "malloc_trim") else None
            except OSError:
                _LIBC = None
    if collect:
        gc.collect()
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))
