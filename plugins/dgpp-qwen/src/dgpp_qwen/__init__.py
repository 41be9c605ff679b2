"""dgpp plugin for the Qwen model families."""
