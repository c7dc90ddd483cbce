"""A ``Structure`` as an xgrammar grammar: the one translation every engine and the up-front check share.

xgrammar is what SGLang and vLLM use for structured outputs, and it runs on a CPU. Building a grammar needs no
tokenizer, so the pipeline can check every distinct structure of a job before the model loads; an engine then
compiles the same grammar against its tokenizer. The translation itself is the library's
(``dspine.decoding.grammar.grammar_of``: compact JSON, ``choice`` as an EBNF alternation), so what is checked is
what runs. xgrammar is imported on first use only: it costs seconds (it imports torch and transformers).
"""

from __future__ import annotations

from typing import Any

from dspine_batch.engines.base import Structure


def grammar_of(structure: Structure) -> Any:
    """The ``xgrammar.Grammar`` of ``structure``; raises ``ValueError`` with xgrammar's reason, in one line."""
    from dspine.decoding.grammar import grammar_of as library_grammar_of

    return library_grammar_of(structure.kind, structure.spec)
