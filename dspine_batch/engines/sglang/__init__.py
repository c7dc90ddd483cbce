"""The SGLang engine: ``sglang.Engine`` in-process, driven by the batch pipeline.

Holds the engine adapter (``engine.py``), the mapping from ``--engine-arg`` to SGLang server arguments
(``args.py``), supervision of SGLang's worker processes (``processes.py``) and the normalisation of SGLang's
``meta_info`` stats across its name vintages (``stats.py``, also used by the scripted engine). Importing this
package does not import SGLang.

May import: ``dspine_batch.engines``, ``dspine.sglang``, ``dspine_batch.errors``.
"""
