"""dgpp plugin for the Qwen model families."""

__version__ = "0.1.0"
