"""dgpp plugin for the Flint model families."""

__version__ = "0.1.0"
