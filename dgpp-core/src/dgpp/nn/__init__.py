"""Shared layers with torch reference paths: norms, rotary, paged attention, MLP, MoE, embedding, linear; the
row-exact CUDA kernels and the layers' side of a step's route in ``nn.exact``; the TP collectives they need."""
