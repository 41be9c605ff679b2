"""Layers only Qwen3.8-Flash-Next (qwen4_exp) uses: QSA and its indexer, gated residual streams, PLE n-grams."""
