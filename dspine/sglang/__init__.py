"""DSPINE as an SGLang 0.5.23 plugin (no fork of SGLang).

Importing this package does not import SGLang; `dspine.sglang.plugin.register()` does.
"""

SGLANG_VERSION = "0.5.23"
ALGORITHM_NAME = "DSPINE"
ENTRY_POINT_NAME = "dspine"
