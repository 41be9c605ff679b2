"""The engine: cache pools, ForwardBatch, the model runner, memory plan, graphs, speculation."""
