"""Reference target models and what reads a Hugging Face model directory.

Holds the target contract (``target.py``: what the decoding loop calls), ``registry.py`` (``load_target``:
architecture -> class), one file per architecture (``llama.py`` for the dense block: Llama, Qwen3 and the families
that are it with options, read per family by ``families.py``: Qwen2/2.5, Mistral, Gemma 3, SmolLM3, OLMo 2, Granite,
Phi-3; ``qwen3_5.py`` for the Qwen3.5 Gated-DeltaNet hybrid), their building blocks (``layers.py``, explicit
batched caches in ``cache.py``, Gated-DeltaNet math in ``gdn.py``, ReplaySSM rollback in ``replay.py``), checkpoint
I/O (``checkpoint.py``) and the tokenizer + chat template of an HF model dir (``tokenizer.py``). ReplaySSM lives
here, not in ``decoding``, because it is how a hybrid target commits a verify: the loop only calls
``Target.commit``.

May import: ``dspine.cpu``.
"""
