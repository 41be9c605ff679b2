"""dgpp plugin for the GLM model families."""

__version__ = "0.1.0"
