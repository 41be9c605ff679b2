"""dgpp plugin for the DeepSeek model families."""
