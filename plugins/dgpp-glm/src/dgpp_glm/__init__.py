"""dgpp plugin for the GLM model families."""
