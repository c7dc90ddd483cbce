"""Generation backends behind one protocol: the pipeline sends ``Request`` in and gets ``Result`` out.

Holds the protocol (``base.py``: ``Request``, ``Result``, ``SamplingParams``, ``Structure``, ``Engine`` and the
request features it may declare, ``derive_seed``), structures as xgrammar grammars (``grammar.py``), engines
by name (``registry.py``), what every engine does with ``--model`` / ``--draft`` (``models.py``), stop strings
(``stop_strings.py``), and the engines: the CPU reference engine over ``dspine`` (``reference.py``), SGLang
(``sglang/``: the in-process engine, server-argument mapping, process supervision, stats normalisation) and the
deterministic scripted engine the tests use (``scripted.py``).

May import: ``dspine`` (the library), ``dspine_batch.errors``, ``dspine_batch.digest``. Never the run or what it
reads and writes. ``decisions.py`` keeps what an engine decided about its proposal sources with the run.
"""
