"""DSPINE as an SGLang 0.5.23 plugin (no fork of SGLang): ``--speculative-algorithm DSPINE``.

Holds the plugin's registration (``plugin.py``, the ``sglang.srt.plugins`` entry point), the algorithm and its
worker (``algo.py``, ``worker.py``), the draft model as SGLang loads it (``models/``) with the math shared with
the reference draft (``draft_math.py``), the suffix proposals beside the draft (``suffix.py``, over
``dspine.decoding.suffix``), config checks (``config.py``), and the CPU test path's bridges
(``cpu.py``, ``cpu_kernels.py``, the ``stand_in`` sgl_kernel). Importing this package does not import SGLang;
``dspine.sglang.plugin.register()`` does. See ``docs/design.md``, "The SGLang plugin".

May import: ``dspine.draft``, ``dspine.decoding``, ``dspine.models``, ``dspine.cpu`` (and SGLang, lazily).
"""

SGLANG_VERSION = "0.5.23"
ALGORITHM_NAME = "DSPINE"
ENTRY_POINT_NAME = "dspine"
# ``meta_info`` key of a request's verify rounds and drafted tokens by source (``suffix.SourceCounts``), which
# ``dspine_batch``'s SGLang engine turns into its ``dspine_*`` / ``suffix_*`` columns
SOURCE_COUNTS_KEY = "dspine_source_counts"
