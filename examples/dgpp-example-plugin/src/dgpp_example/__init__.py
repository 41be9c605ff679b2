"""dgpp-example-plugin: a tiny third-party model family ("toy") for dgpp, built on torch only."""

__version__ = "0.1.0"
