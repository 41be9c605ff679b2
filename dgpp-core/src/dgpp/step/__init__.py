"""What one model step is: its ``ForwardBatch``, the cache pools it reads and writes, the cache specs a model
declares, and the step's route (which rows take the canonical CUDA kernels). Below ``nn``, ``quant`` and the
engine, so layers and the runner share these types without importing each other."""
