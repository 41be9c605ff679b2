"""An independent float64 reference for DeepSeek-V4.1-Flash (``deepseek_v41``), written from the release's
config and the original engine's source (github.com/HawkBearPig/dgpp: ``src/models/dsv41``,
``src/kernels/csa2.*``), which follows the release's ``inference/model.py``. It imports nothing from dgpp: the
checkpoint is read as raw safetensors and every packed weight is decoded from its bit fields
(``deepseek_v41_formats``).

The walk (single-pass hyper-connections, ``hc_mult`` streams):

    x = embed(token) on every stream;  pre = (1, 0, ..., 0)
    per layer:  (Engram layers: x = engram(x))
                (pre_a, post_a, comb_a) = mixes(x, hc_attn);  x = post_a * CSA2(attn_norm(collapse(x, pre))) + comb_a^T x
                (pre_f, post_f, comb_f) = mixes(x, hc_ffn);   x = post_f * MoE(ffn_norm(collapse(x, pre_a))) + comb_f^T x
                pre = pre_f
    logits = head(norm(collapse(x, pre)))

``mixes``: the ``hc_mult * hidden`` streams RMS-normalised (no weight), projected by ``fn`` ``[(2 + hc) hc, hc
hidden]``; ``pre = sigmoid(m0 * scale0 + base0) + hc_eps``, ``post = 2 sigmoid(m1 * scale1 + base1)``, ``comb`` the
``[hc, hc]`` softmax over its last axis plus ``hc_eps``, then column-normalised, then ``hc_sinkhorn_iters - 1``
row / column normalisations (each sum plus ``hc_eps``); the residual update is ``out_k = post_k y + sum_j comb[j,
k] x_j``. MoE: ``sqrt(softplus(u gate^T))`` scores, the top ``num_experts_per_tok`` of ``scores + bias`` chosen,
weighted by their unbiased scores normalised (sum + 1e-20) and times ``routed_scaling_factor``; SwiGLU experts
with the up branch clamped to ``+-swiglu_limit`` and the gate branch from above; one shared expert.

Prefill-exact semantics: every row sees exactly what a one-shot prefill shows it. ``ReferenceSession.extend``
takes the rows in any chunks (one at a time is the decode form) and gives the same logits as ``forward``;
``extend(ids, bounded=True)`` is the original engine's lossy bounded prefill instead (``DeepseekV41Reference.run``).
``new_session(trace=True)`` records every layer's sublayer inputs / outputs, streams and selections.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from deepseek_v41_formats import (
    RawTensor,
    decode_engram_rows,
    decode_fp8_block,
    decode_mxfp4,
    read_safetensors,
)
from deepseek_v41_reference_config import V41Config, load_config
from deepseek_v41_reference_csa2 import (
    CallShared,
    GroupCache,
    ReferenceOptions,
    attention,
    publish_rows,
    rms_norm,
    top_margin,
)
from deepseek_v41_reference_engram import EngramHasher, compressed_token_map, engram

F64 = torch.float64
Weights = dict[str, torch.Tensor]

__all__ = [
    "DeepseekV41Reference",
    "ReferenceOptions",
    "ReferenceSession",
    "assert_matches_reference",
    "load_reference",
    "load_weights",
]


# ---- the checkpoint -------------------------------------------------------------------------------------------------


def _shards(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint_dir / f for f in files]
    return sorted(checkpoint_dir.glob("*.safetensors"))


def decode_tensors(stored: dict[str, RawTensor]) -> Weights:
    """The release's tensors -> float64 by name: packed ``X.weight`` + ``X.scale`` pairs become one decoded
    ``X.weight`` (E4M3 + 32 x 32 E8M0 blocks; I8 MXFP4 pairs + E8M0 / 32; Engram rows E4M3 + E8M0 / 32)."""
    out: Weights = {}
    for name, t in stored.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in stored:
            continue
        base = name[: -len(".weight")]
        scale = stored.get(base + ".scale") if name.endswith(".weight") else None
        if t.dtype == "F8_E4M3":
            if scale is None:
                raise ValueError(f"{name}: an F8_E4M3 weight without {base}.scale")
            if ".engram.embed." in name:
                out[name] = decode_engram_rows(t.codes(), scale.codes())
            else:
                out[name] = decode_fp8_block(t.codes(), scale.codes())
        elif t.dtype == "I8" and scale is not None:
            out[name] = decode_mxfp4(t.codes(), scale.codes())
        else:
            out[name] = t.to_f64()
    return out


def load_weights(checkpoint_dir: str | Path) -> Weights:
    stored: dict[str, RawTensor] = {}
    for shard in _shards(Path(checkpoint_dir)):
        stored.update(read_safetensors(shard))
    return decode_tensors(stored)


# ---- hyper-connections and MoE -----------------------------------------------------------------------------------


def hc_mixes(cfg: V41Config, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor):
    hc = cfg.hc_mult
    flat = rms_norm(x.flatten(1), None, cfg.rms_norm_eps)
    m = flat @ fn.T
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc).softmax(-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * x).sum(1)


def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return post[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, x)


def expert(cfg: V41Config, w: Weights, p: str, u: torch.Tensor) -> torch.Tensor:
    gate, up = u @ w[p + "w1.weight"].T, u @ w[p + "w3.weight"].T
    if cfg.swiglu_limit > 0:
        up = up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        gate = gate.clamp(max=cfg.swiglu_limit)
    return F.silu(gate) * up


def route(
    cfg: V41Config, w: Weights, layer: int, u: torch.Tensor, block: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the unbiased scores, the biased ones the experts are chosen by) ``[rows, n_routed_experts]``. ``block``:
    the tensors' prefix when not ``layers.<layer>.`` (a draft stage's ``mtp.<s>.``)."""
    p = (block or f"layers.{layer}.") + "ffn."
    logits = (u @ w[p + "gate.weight"].T) / cfg.gate_temp
    if cfg.scoring_func == "softmax":
        scores = logits.softmax(-1)
    elif cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    return scores, scores + w[p + "gate.bias"]


def moe(
    cfg: V41Config, w: Weights, layer: int, u: torch.Tensor, block: str | None = None, top_k: int = 0
) -> torch.Tensor:
    """``block`` / ``top_k``: a draft stage's prefix and routed experts per token (default the layer's)."""
    p = (block or f"layers.{layer}.") + "ffn."
    top_k = top_k or cfg.num_experts_per_tok
    scores, biased = route(cfg, w, layer, u, block)
    chosen = torch.sort(-biased, dim=-1, stable=True).indices[:, :top_k]
    weights = scores.gather(1, chosen)
    if cfg.norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    out = expert(cfg, w, p + "shared_experts.", u) @ w[p + "shared_experts.w2.weight"].T
    for t in range(u.shape[0]):
        for e, g in zip(chosen[t].tolist(), weights[t].tolist(), strict=True):
            q = f"{p}experts.{e}."
            out[t] += g * (expert(cfg, w, q, u[t]) @ w[q + "w2.weight"].T)
    return out


# ---- the model ----------------------------------------------------------------------------------------------------


@dataclass
class ReferenceSession:
    """One sequence's state: the tokens so far, every layer's window latents, the kv sources' groups.

    With ``trace`` a list, every call appends one record per layer (each ``[rows, ...]`` float64 for the call's
    rows): ``attn_input`` / ``attn_output`` / ``ffn_input`` / ``ffn_output`` (the normed sublayer inputs and
    the sublayer outputs), ``streams`` (after the layer), ``pre`` (the collapse coefficients the next site
    reads), on compressed layers ``selection`` (bool over the group's entries) and ``candidates``, and
    ``margin``: per row, how close the layer's closest discrete decision came to its boundary (relative: a
    cache rounding's element code or scale, an index / candidate / expert top-k's last pick against the next).
    An fp32 model can take the other side of a decision whose margin is near its rounding noise (~1e-6);
    from that row on its logits may leave the reference's."""

    model: DeepseekV41Reference
    tokens: list[int] = field(default_factory=list)
    window: list[torch.Tensor] = field(default_factory=list)
    groups: dict[int, GroupCache] = field(default_factory=dict)
    trace: list[dict[str, torch.Tensor]] | None = None

    def extend(self, token_ids: list[int], bounded: bool = False) -> torch.Tensor:
        """The next rows' logits ``[len(token_ids), vocab]`` (float64). ``bounded``: the decoder runs over the
        call's last ``sliding_window`` rows only (``DeepseekV41Reference.run``); the rows before read NaN."""
        return self.model.run(self, list(token_ids), bounded)


class DeepseekV41Reference:
    def __init__(
        self, cfg: V41Config, weights: Weights, hasher: EngramHasher | None, options: ReferenceOptions
    ):
        self.cfg, self.w, self.hasher, self.options = cfg, weights, hasher, options

    def new_session(self, trace: bool = False) -> ReferenceSession:
        empty = torch.zeros(0, self.cfg.head_dim, dtype=F64)
        return ReferenceSession(
            self, window=[empty] * self.cfg.num_hidden_layers, trace=[] if trace else None
        )

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Every row's logits ``[T, vocab]`` of a one-shot prefill."""
        return self.new_session().extend(token_ids)

    def run(self, session: ReferenceSession, new: list[int], bounded: bool = False) -> torch.Tensor:
        """The call's rows through every layer. ``bounded`` is the original engine's lossy "decoder SWA bounded
        replay" prefill: the encoder (the layers before the last kv source) over every row; the last kv
        source's compressor publishes every row's entries; the decoder (the last kv source on) then walks only
        the call's last ``sliding_window`` rows, its window floored at their first position (the decoder's
        window latents of earlier rows are never computed). Identical to the exact walk when the call has at
        most ``sliding_window`` rows."""
        cfg, w = self.cfg, self.w
        pos0 = len(session.tokens)
        session.tokens.extend(new)
        positions = torch.arange(pos0, pos0 + len(new))
        shared = CallShared(groups=session.groups)
        x = w["embed.weight"][torch.tensor(new, dtype=torch.long)][:, None, :].repeat(1, cfg.hc_mult, 1)
        pre = torch.zeros(len(new), cfg.hc_mult, dtype=F64)
        pre[:, 0] = 1.0
        decoder = (
            max(cfg.kv_source_layer_ids)
            if bounded and len(new) > cfg.sliding_window
            else cfg.num_hidden_layers
        )
        if any(e >= decoder for e in cfg.engram_layer_ids):
            raise ValueError("engram_layer_ids: the bounded prefill needs every Engram layer in the encoder")
        floor, carried = 0, None
        for layer in range(cfg.num_hidden_layers):
            if layer == decoder:
                if session.trace is not None:
                    shared.margin = torch.full((len(new),), math.inf, dtype=F64)
                site = self.site_input(layer, "attn", x, pre)
                publish_rows(cfg, self.options, w, layer, site, shared, positions)
                keep = cfg.sliding_window
                x, pre, positions = x[-keep:], pre[-keep:], positions[-keep:]
                carried = None if shared.margin is None else shared.margin[-keep:]
                floor = int(positions[0])
            x, pre = self.layer(
                session,
                layer,
                x,
                pre,
                positions,
                shared,
                publish=layer != decoder,
                floor=floor,
                margin=carried,
            )
        h = rms_norm(collapse(x, pre), w["norm.weight"], cfg.rms_norm_eps)
        logits = torch.full((len(new), cfg.vocab_size), math.nan, dtype=F64)
        logits[len(new) - h.shape[0] :] = h @ w["head.weight"].T
        return logits

    def site_input(self, layer: int, site: str, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """A sublayer's normed input: the streams collapsed with ``pre`` (the single-pass reading) or with this
        site's own fresh coefficients (``single_pass_hc=False``)."""
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}.hc_{site}_"
        if not self.options.single_pass_hc:
            pre = hc_mixes(cfg, x, w[p + "fn"], w[p + "scale"], w[p + "base"])[0]
        return rms_norm(collapse(x, pre), w[f"layers.{layer}.{site}_norm.weight"], cfg.rms_norm_eps)

    def layer(
        self,
        session: ReferenceSession,
        layer: int,
        x: torch.Tensor,
        pre: torch.Tensor,
        positions: torch.Tensor,
        shared: CallShared,
        publish: bool = True,
        floor: int = 0,
        margin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the call's streams ``x`` ``[rows, hc, hidden]``: (the streams, the next site's pre).
        Traced, the layer's decision margins start from ``margin`` (else none)."""
        cfg, w, opts = self.cfg, self.w, self.options
        p = f"layers.{layer}."
        if session.trace is not None:
            shared.margin = torch.full((x.shape[0],), math.inf, dtype=F64) if margin is None else margin
        if layer in cfg.engram_layer_ids and opts.engram:
            if self.hasher is None:
                raise ValueError("the Engram layers need the tokenizer's token map")
            at = range(int(positions[0]), int(positions[-1]) + 1)
            rows = self.hasher.rows(session.tokens, at, cfg.engram_layer_ids.index(layer))
            x = engram(cfg, w, layer, x, rows)
        pre_a, post_a, comb_a = hc_mixes(
            cfg, x, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"], w[p + "hc_attn_base"]
        )
        attn_in = self.site_input(layer, "attn", x, pre)
        attn_out = attention(cfg, opts, w, layer, attn_in, positions, session.window, shared, publish, floor)
        x = expand(attn_out, x, post_a, comb_a)
        pre_f, post_f, comb_f = hc_mixes(
            cfg, x, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"], w[p + "hc_ffn_base"]
        )
        ffn_in = self.site_input(layer, "ffn", x, pre_a)
        ffn_out = moe(cfg, w, layer, ffn_in)
        x = expand(ffn_out, x, post_f, comb_f)
        if session.trace is not None:
            shared.note(top_margin(route(cfg, w, layer, ffn_in)[1], cfg.num_experts_per_tok))
            record = {
                "attn_input": attn_in,
                "attn_output": attn_out,
                "ffn_input": ffn_in,
                "ffn_output": ffn_out,
            }
            record |= {"streams": x, "pre": pre_f, "margin": shared.margin}
            if cfg.ratio(layer) and shared.selection is not None:
                record["selection"] = shared.selection
            if shared.candidates is not None and cfg.ratio(layer):
                record["candidates"] = shared.candidates
            session.trace.append(record)
        return x, pre_f


def assert_matches_reference(
    reference: DeepseekV41Reference,
    prompt: list[int],
    logits: torch.Tensor,
    tol: float = 1e-4,
    near_tie: float = 3e-6,
) -> float:
    """Check a model's every-row ``logits`` of ``prompt`` against the reference: every row agrees within ``tol``
    (max abs) up to the first row that does not, and that row must hold a decision within ``near_tie`` of its
    boundary (a cache rounding or a top-k the model's own rounding can take the other way); later rows are not
    compared. Returns the worst difference of the compared rows."""
    session = reference.new_session(trace=True)
    expected = session.extend(prompt)
    margin = torch.stack([record["margin"] for record in session.trace]).min(0).values
    diff = (logits.to(F64).cpu() - expected).abs().max(-1).values
    off = (diff > tol).nonzero()
    if len(off):
        row = int(off[0])
        if margin[row] >= near_tie:
            raise AssertionError(
                f"row {row} of {len(prompt)} differs by {float(diff[row]):.3g} (> {tol}) while its closest "
                f"decision is {float(margin[row]):.2g} from its boundary (>= {near_tie}): a disagreement"
            )
        diff = diff[:row]
    return float(diff.max()) if diff.numel() else 0.0


def load_reference(
    checkpoint_dir: str | Path, options: ReferenceOptions | None = None
) -> DeepseekV41Reference:
    """The reference of a release-layout checkpoint directory (``config.json``, ``*.safetensors``, and
    ``tokenizer.json`` when the config has Engram layers)."""
    ckpt = Path(checkpoint_dir)
    cfg = load_config(ckpt)
    hasher = None
    if cfg.engram_layer_ids:
        token_map, _ = compressed_token_map(ckpt / "tokenizer.json")
        hasher = EngramHasher.build(cfg, token_map)
    return DeepseekV41Reference(cfg, load_weights(ckpt), hasher, options or ReferenceOptions())
