"""The CPU demo checkpoint: a tiny random Qwen3 with a small byte-level BPE tokenizer, built on first use.

``deploy/demo_cpu.json`` names ``dgpp-demo/qwen3-tiny``; resolving it builds the checkpoint once under
``$DGPP_DEMO_DIR`` (default ``~/.cache/dgpp/demo/``) with a fixed seed, no GPU and no network, so the
whole serving path can be exercised anywhere. The weights are random: the demo answers gibberish,
deterministically. Building needs ``transformers`` (installed by scripts/setup.sh).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dgpp.errors import CheckpointError

DEMO_SEED = 20260101
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# ChatML, as Qwen3 checkpoints use it; reasoning markers are ordinary added tokens here.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
# A fixed training text: the tokenizer's merges come only from it, so they never change.
_CORPUS = [
    "dgpp serves large language models through an OpenAI-compatible API.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Hello! How are you today? I am a tiny demo model with random weights.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Tokens, blocks, slots and caches.",
    "The user asks a question; the assistant thinks, then answers in plain text.",
]


def demo_cache_dir() -> Path:
    """Where demo checkpoints are kept: ``$DGPP_DEMO_DIR``, else ``~/.cache/dgpp/demo``."""
    return Path(os.environ.get("DGPP_DEMO_DIR") or "~/.cache/dgpp/demo").expanduser()


def _build_tokenizer(out: Path, vocab_size: int) -> None:
    """Train a byte-level BPE (at most ``vocab_size`` entries) on the fixed corpus and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_model(out: Path, vocab_size: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    torch.manual_seed(DEMO_SEED)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)


def build_qwen3_tiny(out: Path) -> None:
    """Write the tiny Qwen3 demo checkpoint (tokenizer + config + safetensors) into ``out``."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a shard-writing bar is noise in a server log
    _build_tokenizer(out, vocab_size=512)

    tok = AutoTokenizer.from_pretrained(out)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    # the embedding is padded past the tokenizer (476 entries), as released checkpoints often are
    _build_model(out, vocab_size=512, eos_id=eos_id, pad_id=pad_id)


DEMO_BUILDERS = {"qwen3-tiny": build_qwen3_tiny}


def ensure_demo_checkpoint(model: str) -> Path:
    """The directory of demo model ``dgpp-demo/<name>``, building it on first use (safe under concurrency)."""
    name = model.split("/", 1)[1]
    builder = DEMO_BUILDERS.get(name)
    if builder is None:
        raise CheckpointError(f"model {model!r}: no such demo checkpoint (demos: {', '.join(sorted(DEMO_BUILDERS))})")
    final = demo_cache_dir() / name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    from dgpp.log import get_logger

    get_logger("dgpp.demo").info("building demo checkpoint", model=model, path=str(final))
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        builder(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache should be readable
        try:
            tmp.rename(final)  # atomic: a reader sees no checkpoint or a complete one
        except OSError:
            if not (final / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":  # python -m dgpp.demo: build (or find) the demo checkpoint and print its path
    print(ensure_demo_checkpoint(f"dgpp-demo/{next(iter(DEMO_BUILDERS))}"))
