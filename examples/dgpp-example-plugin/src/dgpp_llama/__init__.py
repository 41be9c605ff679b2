"""dgpp-llama: the Llama model family (LlamaForCausalLM) as a third-party dgpp plugin."""
