"""The text stack: tokenizer, streaming detokenizer, chat templates, tool dialects, grammars.

What the serving path uses (``dgpp.server_assembly`` builds it). Per model, once: ``Tokenizer.from_dir``,
``ChatTemplate.for_checkpoint``, the family's ``Dialect`` from the ``dgpp_tool_dialect`` hook, a
``GrammarContext``. Per request: ``ChatTemplate.render``
-> ``Tokenizer.encode``; ``build_matcher`` for a constrained request (the sampler calls ``mask`` / ``accept``
/ ``is_done``); per choice the serving side's ``OutputProcessor`` (``dgpp.serve.output_processor``) drives an
``IncrementalDetokenizer`` and the dialect's ``ToolCallStream``.
"""

from __future__ import annotations

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.detokenizer import IncrementalDetokenizer, StopMatch
from dgpp.text.dialect import Dialect, ParsedOutput, ToolCall, ToolCallStream, call_id
from dgpp.text.effort import EffortMapping
from dgpp.text.errors import GrammarError, TemplateError, TextError, TokenizerError
from dgpp.text.grammar import GrammarContext, GrammarMatcher, build_matcher
from dgpp.text.tokenizer import Tokenizer
from dgpp.text.tools import ToolSpec, tool_specs

__all__ = [
    "ChatTemplate",
    "Dialect",
    "EffortMapping",
    "GrammarContext",
    "GrammarError",
    "GrammarMatcher",
    "IncrementalDetokenizer",
    "ParsedOutput",
    "StopMatch",
    "TemplateError",
    "TextError",
    "Tokenizer",
    "TokenizerError",
    "ToolCall",
    "ToolCallStream",
    "ToolSpec",
    "build_matcher",
    "call_id",
    "tool_specs",
]
