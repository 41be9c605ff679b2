"""The engine: the model runner (one ``ForwardBatch`` per step, its route set), decode CUDA graphs, the memory
plan, loading, speculative decoding. The step's types themselves (``ForwardBatch``, pools, cache specs) are
``dgpp.step``'s."""
