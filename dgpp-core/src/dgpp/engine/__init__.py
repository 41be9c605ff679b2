"""The engine at serving time, what runs every step: the model runner (one ``ForwardBatch`` per step, its route
set), decode CUDA graphs and their inputs, a step's work (``SeqWork``), speculative decoding (drafts, verify,
judging, acceptance counters) and prompt-lookup drafts. What runs once before serving (the deployment, loading,
the memory plan, the checks against the loaded model, building the speculative decoder) is ``dgpp.startup``'s;
the step's types themselves (``ForwardBatch``, pools, cache specs) are ``dgpp.step``'s."""
