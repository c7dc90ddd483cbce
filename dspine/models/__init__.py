"""Reference target models and what reads a Hugging Face model directory.

Holds the target contract (``target.py``: what the decoding loop calls), ``registry.py`` (``load_target``:
architecture -> class), one file per architecture (``llama.py`` for Llama / Qwen3 dense, ``qwen3_5.py`` for the
Qwen3.5 Gated-DeltaNet hybrid), their building blocks (``layers.py``, explicit batched caches in ``cache.py``,
Gated-DeltaNet math in ``gdn.py``, ReplaySSM rollback in ``replay.py``), checkpoint I/O (``checkpoint.py``) and the
tokenizer + chat template of an HF model dir (``tokenizer.py``). ReplaySSM lives here, not in ``decoding``,
because it is how a hybrid target commits a verify: the loop only calls ``Target.commit``.

May import: ``dspine.cpu``.
"""
