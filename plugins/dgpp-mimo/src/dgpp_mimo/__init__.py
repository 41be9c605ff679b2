"""dgpp plugin for the MiMo model families."""

__version__ = "0.1.0"
