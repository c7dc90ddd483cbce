"""The CPU step: what makes a forward fast on this processor, independent of any model.

Holds the JIT-built C++ kernels (``kernels.py`` + ``csrc/``: packed decode-shaped linears, fused norm / RoPE /
attention / SiLU ops, the on-disk pack cache), weight-only quantization (``quant.py``), the ``dtype``/``quant``
precision settings (``precision.py``), the torch thread governor (``threads.py``) and where dspine caches what it
computes once per machine (``disk_cache.py``). See ``docs/design.md``, "The CPU step".

May import: nothing of dspine (torch and the standard library only); every other package builds on it.
"""
