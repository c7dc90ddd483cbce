"""Kept for test files not yet moved to ``tests/helpers.py``: re-exports its draft test doubles."""

from helpers import LookaheadDraft, Proposal, RandomDraft, ScriptedDraft

__all__ = ["LookaheadDraft", "Proposal", "RandomDraft", "ScriptedDraft"]
