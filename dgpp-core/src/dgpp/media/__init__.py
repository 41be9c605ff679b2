"""Image inputs: decoding request images (``decode``) and what a prompt carries for them through the engine
(``prompt``: processed pixels, placeholder spans, multimodal rotary positions, prefix-cache key)."""
