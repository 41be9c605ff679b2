"""dgpp plugin for the MiMo model families."""
