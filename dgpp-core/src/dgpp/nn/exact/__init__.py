"""Row exactness on CUDA: the kernels whose rows do not depend on the other rows of a call (``gemm``,
``attention``), and the layers' side of a step's route (``routing`` for linears, ``recurrent`` for gated
DeltaNet and causal conv). The route itself is decided by the engine: ``dgpp.step.route``."""
