"""The Qwen3.5 hybrids' MTP layer (``mtp.*``), loaded through the Qwen plugin's ``dgpp_build_draft`` hook, vs a
float64 reference. transformers drops ``mtp.*`` and has no MTP module, so the reference runs transformers' own
decoder-layer and norm classes in float64 on the ``mtp.*`` tensors, glued as the layout says: ``fc`` over
``[norm(embed(token p+1)) | norm(final hidden at p)]``, one full-attention layer, the MTP norm, the shared head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.family import LoadContext
from dgpp.plugins import manager
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.mtp import draft_logits
from dgpp_qwen.qwen3_5_mtp import Qwen35MTPDrafter

RTOL = 1e-4


def _hf_mtp(text_config) -> torch.nn.ModuleDict:
    """One MTP layer as transformers modules; ``state_dict()`` names are the checkpoint's after ``mtp.``."""
    if text_config.model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

        layer_cls, norm_cls = hf.Qwen3_5MoeDecoderLayer, hf.Qwen3_5MoeRMSNorm
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        layer_cls, norm_cls = hf.Qwen3_5DecoderLayer, hf.Qwen3_5RMSNorm
    hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
    full_attention = text_config.layer_types.index(
        "full_attention"
    )  # the MTP layer is a full-attention layer
    return torch.nn.ModuleDict(
        {
            "pre_fc_norm_embedding": norm_cls(hidden, eps=eps),
            "pre_fc_norm_hidden": norm_cls(hidden, eps=eps),
            "fc": torch.nn.Linear(2 * hidden, hidden, bias=False),
            "layers": torch.nn.ModuleList([layer_cls(text_config, full_attention)]),
            "norm": norm_cls(hidden, eps=eps),
        }
    )


def _build(kind: str, out: Path, seed: int) -> Path:
    """A tiny checkpoint of ``kind`` plus random ``mtp.*`` tensors in its safetensors file."""
    import transformers

    path = build_tiny_checkpoint(kind, out, seed=seed)
    text = transformers.AutoConfig.from_pretrained(path).get_text_config()
    mtp = _hf_mtp(text)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(mtp.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(p + noise * 0.2 if p.dim() == 1 else noise * 0.08)  # norms perturbed off their init
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update({f"mtp.{name}": t.contiguous() for name, t in mtp.state_dict().items()})
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=("qwen3_5", "qwen3_5_moe_vl"))
def loaded(request, tmp_path_factory):
    path = _build(request.param, tmp_path_factory.mktemp(request.param), seed=17)
    model = load_model(path)
    hf_config = read_hf_config(path)
    ctx = LoadContext(path, hf_config, "qwen", hf_config["architectures"][0])
    return path, model, manager().hook.dgpp_build_draft(ctx=ctx, model=model)


@torch.inference_mode()
def _reference(path: Path, tokens: list[int]) -> torch.Tensor:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    ref = (
        getattr(transformers, cfg.architectures[0])
        .from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
        )
        .eval()
    )
    text_model = ref.model.language_model if hasattr(ref.model, "language_model") else ref.model
    text = cfg.get_text_config()
    text._attn_implementation = "eager"
    text._experts_implementation = "eager"
    mtp = _hf_mtp(text).double().eval()
    stored = load_file(str(path / "model.safetensors"))
    mtp.load_state_dict({k[len("mtp.") :]: v.double() for k, v in stored.items() if k.startswith("mtp.")})
    ids = torch.tensor([tokens])
    n = len(tokens) - 1
    hidden = text_model(ids[:, :-1]).last_hidden_state  # after the final norm
    x = mtp["fc"](
        torch.cat(
            [
                mtp["pre_fc_norm_embedding"](text_model.embed_tokens(ids[:, 1:])),
                mtp["pre_fc_norm_hidden"](hidden),
            ],
            dim=-1,
        )
    )
    position_embeddings = text_model.rotary_emb(x, torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
    causal = torch.full((n, n), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    x = mtp["layers"][0](x, position_embeddings=position_embeddings, attention_mask=causal, cache=None)
    return ref.lm_head(mtp["norm"](x))[0]


def test_drafter_loads_mtp_tensors(loaded):
    path, model, drafter = loaded
    assert isinstance(drafter, Qwen35MTPDrafter)
    assert set(drafter.cache_spec()) == {"mtp.layers.0"}
    stored = load_file(str(path / "model.safetensors"))
    torch.testing.assert_close(drafter.fc.weight, stored["mtp.fc.weight"], rtol=0, atol=0)
    # the head and embedding are the main model's, not copies
    assert drafter._vocab.head is model.lm_head
    assert not any(name.startswith(("embed", "lm_head")) for name, _ in drafter.named_parameters())


@pytest.mark.parametrize("chunks", [[30], [7, 12, 11]], ids=["one_shot", "chunked"])
def test_mtp_logits_match_float64_reference(loaded, chunks):
    path, model, drafter = loaded
    tokens = torch.randint(0, 512, (31,), generator=torch.Generator().manual_seed(18)).tolist()
    ours = draft_logits(model, drafter, tokens, chunks).double()
    theirs = _reference(path, tokens)
    worst = float(((ours - theirs).abs().max(-1).values / theirs.abs().max()).max())
    assert worst < RTOL, f"MTP logits differ from the float64 reference by {worst:.3g} relative"


def test_checkpoint_without_mtp_has_no_drafter(tmp_path):
    path = build_tiny_checkpoint("qwen3_5", tmp_path, seed=19)
    ctx = LoadContext(path, read_hf_config(path), "qwen", "Qwen3_5ForCausalLM")
    assert manager().hook.dgpp_build_draft(ctx=ctx, model=load_model(path)) is None
