"""dgpp plugin for the Flint model families."""
