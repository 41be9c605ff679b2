"""dgpp plugin for the DeepSeek model families."""

__version__ = "0.1.0"
