"""Lossless speculative decoding: the loop, and everything it decides per round.

Holds the decoding loop with continuous batching (``decode.py``: ``generate``, ``decode_stream``), moving rows in
and out of a running batch (``batching.py``), the cost-aware choice of how many drafts to verify per row
(``schedule.py``) and the measured cost model it uses (``cost.py``), lossless acceptance (``verify.py``) and the
processed target distribution with position-keyed randomness (``sampling.py``). The draft is used through its
methods only, so any object with ``propose`` works (tests use scripted drafts). See ``docs/design.md``,
"Verification and sampling".

May import: ``dspine.models``, ``dspine.cpu``.
"""
