"""The DSpine draft model: a block drafter that reads the target's own features.

Holds its ``config.json`` (``config.py``), the model (``model.py``: causal in-block attention, adjacent causal
injection, last-write refinement, confidence head), the proposal (``proposal.py``: transition cache and the path
sampled through it), the transfer space (``transfer.py``) and checkpoint init/load (``io.py``: ``init_draft``,
``load_draft``; ``DSpineDraft.save`` writes). ``model`` imports ``proposal``, never the reverse. See
``docs/design.md``, "The DSpine draft".

May import: ``dspine.models``, ``dspine.cpu``.
"""
