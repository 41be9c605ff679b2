"""The text stack: tokenizer, streaming detokenizer, chat templates, reasoning split, tool dialects, grammars.

What the serving path uses, per model: ``Tokenizer.from_dir`` and ``ChatTemplate.for_checkpoint`` once;
per request: ``ChatTemplate.render`` -> ``Tokenizer.encode``; per generated token:
``IncrementalDetokenizer.push`` -> ``ReasoningSplitter.push`` -> ``Dialect`` stream parser; and, for
constrained requests, a ``GrammarMatcher`` from ``build_matcher`` that the sampler masks with.
"""

from __future__ import annotations

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.detokenizer import IncrementalDetokenizer, StopMatch
from dgpp.text.effort import EffortMapping
from dgpp.text.errors import GrammarError, TemplateError, TextError, TokenizerError
from dgpp.text.tokenizer import Tokenizer
from dgpp.text.tools import ToolSpec, tool_specs

__all__ = [
    "ChatTemplate",
    "EffortMapping",
    "GrammarError",
    "IncrementalDetokenizer",
    "StopMatch",
    "TemplateError",
    "TextError",
    "Tokenizer",
    "TokenizerError",
    "ToolSpec",
    "tool_specs",
]
