"""Training a DSpine draft against a frozen target.

Holds the trainer (``train.py``: ``dspine train``, resumable), its on-disk state (``train_state.py``),
teacher-forced targets (``teacher.py``) and the confidence-head fit (``confidence.py``). Nothing at inference
time imports this package. See ``docs/design.md``, "Training, in one paragraph".

May import: ``dspine.draft``, ``dspine.decoding``, ``dspine.models``, ``dspine.cpu``.
"""
