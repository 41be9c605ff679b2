"""dgpp-llama: the Llama model family (LlamaForCausalLM) as a third-party dgpp plugin."""

__version__ = "0.1.0"
