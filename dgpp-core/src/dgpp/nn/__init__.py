"""Shared layers with torch reference paths: norms, rotary, paged attention, MLP, MoE, embedding, linear."""
