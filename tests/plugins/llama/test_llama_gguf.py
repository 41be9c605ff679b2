"""GGUF checkpoints of the Llama family: a tiny random Llama written as GGUF with the ``gguf`` writer (the
way llama.cpp's converter lays it out: its names, its q/k row order) is converted by dgpp and served by the
plugin. F32 files must reproduce the safetensors weights bit for bit and transformers' logits; quantized
files must match transformers' own GGUF loader. The tokenizer and chat template come from the metadata."""

from __future__ import annotations

import json

import pytest
import torch

from dgpp.checkpoint.resolve import resolve_checkpoint
from dgpp.errors import CheckpointError
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint, load_reference
from dgpp.testing.tokenizers import TINY_CHAT_TEMPLATE, build_tiny_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip(
    "dgpp_llama", reason="the example plugin (examples/dgpp-example-plugin) is installed by scripts/setup.sh"
)

from gguf_writer import write_llama_gguf  # noqa: E402  (needs gguf)


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DGPP_GGUF_DIR", str(tmp_path / "gguf-cache"))


def tiny_llama(root, *, seed=0, **overrides):
    path = build_tiny_checkpoint("llama", root / "hf", seed=seed, overrides=overrides or None)
    build_tiny_tokenizer(path)
    return path


def mixed_quant(name: str, tensor: torch.Tensor) -> str:
    """Q4_1 for the MLP, Q8_0 for attention, Q4_0 for the embedding, F32 for norms (what releases mix)."""
    if tensor.dim() == 1:
        return "F32"
    if ".mlp." in name:
        return "Q4_1"
    return "Q4_0" if "embed_tokens" in name else "Q8_0"


@pytest.mark.parametrize("tied", [False, True])
def test_f32_gguf_reproduces_the_checkpoint_and_transformers(tmp_path, tied):
    from safetensors.torch import load_file

    hf = tiny_llama(tmp_path, seed=4, tie_word_embeddings=tied)
    gguf_path = write_llama_gguf(hf, tmp_path / "tiny.gguf", chat_template=TINY_CHAT_TEMPLATE)
    converted = resolve_checkpoint(str(gguf_path))
    ours, original = load_file(str(converted / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert ours.keys() == original.keys()
    for name in original:  # names mapped back and q/k rows un-permuted: every weight bit for bit
        assert torch.equal(ours[name], original[name]), name
    assert resolve_checkpoint(str(tmp_path)) == converted  # a directory holding one .gguf, cached
    model, ref = load_model(converted), load_reference(hf)
    prompts = conf.make_prompts(model.info.vocab_size, (4, 17, 30), seed=5)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4
    conf.check_greedy(model, ref, prompts[:2], max_new_tokens=24)


def test_quantized_gguf_matches_transformers_gguf_loader(tmp_path):
    import transformers

    hf = tiny_llama(tmp_path, seed=7)
    gguf_path = write_llama_gguf(hf, tmp_path / "q" / "tiny-q.gguf", tensor_type=mixed_quant)
    model = load_model(resolve_checkpoint(str(gguf_path)))
    ref = transformers.LlamaForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, attn_implementation="eager", dtype=torch.float32
    ).eval()
    prompts = conf.make_prompts(model.info.vocab_size, (6, 21), seed=8)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4
    conf.check_greedy(model, ref, prompts, max_new_tokens=24)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    from tokenizers import Tokenizer

    from dgpp.text.tokenizer import Tokenizer as DgppTokenizer

    hf = tiny_llama(tmp_path, seed=1)
    converted = resolve_checkpoint(
        str(write_llama_gguf(hf, tmp_path / "t.gguf", chat_template=TINY_CHAT_TEMPLATE))
    )
    original, rebuilt = (
        Tokenizer.from_file(str(hf / "tokenizer.json")),
        Tokenizer.from_file(str(converted / "tokenizer.json")),
    )
    for text in [
        "Hello world! What is the weather in Paris?",
        "<|im_start|>user\n你好 😀<|im_end|>",
        "  x = 3.14\n",
    ]:
        assert rebuilt.encode(text).ids == original.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids, skip_special_tokens=False) == text
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == TINY_CHAT_TEMPLATE and cfg["eos_token"] is not None
    tok = DgppTokenizer.from_dir(converted)
    assert tok.chat_template == TINY_CHAT_TEMPLATE


def test_unsupported_content_is_named(tmp_path):
    hf = tiny_llama(tmp_path, seed=2)

    def with_q5_0(name: str, tensor: torch.Tensor) -> str:
        return "Q5_0" if name == "model.layers.0.mlp.down_proj.weight" else "F32"

    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.ffn_down.weight'.*Q5_0 is not supported"):
        bad = write_llama_gguf(hf, tmp_path / "k.gguf", tensor_type=with_q5_0)
        resolve_checkpoint(str(bad))
    writer = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"general.architecture 'mamba' is not supported"):
        resolve_checkpoint(str(tmp_path / "arch.gguf"))
    assert not list((tmp_path / "gguf-cache").glob("arch-*"))  # nothing half-converted is left behind
