"""Errors of the text stack; each names the request field (``param``) the API reports it under."""

from __future__ import annotations

from dgpp.errors import DgppError


class TextError(DgppError):
    """Base of text-stack errors: ``param`` is the request field the API's 400 names."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class TemplateError(TextError):
    """The chat template failed to render (or was asked for something it does not accept).

    The API answers 400 naming ``param`` (``messages`` unless a kwarg or the effort was at fault).
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, param)


class TokenizerError(TextError):
    """A tokenizer file is missing or inconsistent (names the file and the token)."""


class GrammarError(TextError):
    """A response_format / tool schema / tool_choice cannot be compiled (code ``invalid_grammar``)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message, param)
