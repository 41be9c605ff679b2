"""CSA2 attention of one DeepSeek-V4.1-Flash layer (the release's ``attn.*`` names).

``q = rope(wq_b(q_norm(wq_a(x))))`` as ``heads x head_dim`` (no per-head norm), the shared latent
``kv = rope(kv_norm(wkv(x)))`` (K == V), both rotated on their last ``rope_head_dim`` dims as adjacent pairs
(``rope_theta`` on window-only layers, ``compress_rope_theta`` with YaRN elsewhere). The latent is kept in
its trained FP8 form (``round_fp8_e8m0``) in a per-request ring of the window, packed
(``dgpp_deepseek.v41_packed_entries.PackedFP8``). A row at ``p`` attends, in one
softmax with its head's sink logit (denominator only), the window ``p - W + 1 .. p`` and, on compressed
layers, its group's selected entries (``dgpp_deepseek.v41_indexer``): a kv source publishes the group's
entries first, an index source selects, the other layers of the group reuse the last selection. The output's
rope tail is rotated back, then the grouped low-rank output (block-diagonal ``wo_a`` over ``o_groups``,
``wo_b``). Decode-only steps where Triton runs read the packed ring and entries inside the fused kernels
(``dgpp_deepseek.v41_decode``); the torch path here decodes the step's rings and is the reference.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import use_triton
from dgpp.kernels.block_scaled_tiles import PackedKeyForms
from dgpp.kernels.ring_write import RingWriteInputs, ring_write
from dgpp.kernels.window_attention import window_attention
from dgpp.nn.compressed_attention import sparse_window_attention_ref
from dgpp.nn.rotary import RopeScaling, rotary_embedding
from dgpp.plugin_api import CacheSpec, ForwardBatch, WindowKV
from dgpp_deepseek.attention import LatentProjections, grouped_output
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_decode import (
    index_key_forms,
    packed_decode_attention,
    packed_forms,
    per_row_selection,
)
from dgpp_deepseek.v41_indexer import CompressorV41, GroupFlow, IndexerV41
from dgpp_deepseek.v41_latent_formats import round_fp8_e8m0
from dgpp_deepseek.v41_packed_entries import EntryFormats


class DeepseekV41Attention(LatentProjections):
    """One layer's CSA2 attention, replicated on every rank (one K/V head: nothing to split by heads)."""

    def __init__(
        self,
        cfg: DeepseekV41ArchConfig,
        layer_idx: int,
        formats: EntryFormats,
        *,
        dtype: torch.dtype,
        index_topk: int,
    ) -> None:
        super().__init__(cfg, dtype=dtype)
        self.formats = formats  # how the pools and the rings hold their rows (shared by the whole model)
        heads, dim, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.num_heads, self.head_dim, self.groups = heads, dim, cfg.o_groups
        self.window, self.o_lora_rank, self.dtype = cfg.sliding_window, cfg.o_lora_rank, dtype
        self.ratio = cfg.ratio(layer_idx)
        self.cache_name = f"layers.{layer_idx}.attn"
        source = cfg.kv_source_of(layer_idx)
        self.source_name = f"layers.{source}.attn"
        if self.ratio:
            rope = RopeScaling(
                theta=cfg.compress_rope_theta,
                rope_type="yarn" if cfg.compress_yarn else "default",
                yarn=cfg.compress_yarn,
            )
        else:
            rope = RopeScaling(theta=cfg.rope_theta)
        # cos / sin stay fp32 (the original's rotation kernel): rounded to bf16 they move every rotated value by
        # up to 2^-9 before the FP8 / FP4 cache roundings, which turn such moves into whole-step flips
        self.rotary = rotary_embedding(
            rope, dim, cfg.rope_head_dim, style="interleaved", trailing=True, fp32_angles=True
        )
        # decode-only steps read the packed ring and entries in the fused kernels; None: where Triton runs
        self.fused_decode: bool | None = None
        self.compressor: CompressorV41 | None = None
        if source == layer_idx:
            self.compressor = CompressorV41(
                cfg.hidden_size,
                dim,
                cfg.index_head_dim,
                self.ratio,
                self.rotary,
                self.cache_name,
                formats,
                dtype=dtype,
                eps=eps,
            )
        self.indexer: IndexerV41 | None = None
        if cfg.is_index_source(layer_idx):
            self.indexer = IndexerV41(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                index_topk,
                self.rotary,
                formats,
                dtype=dtype,
            )
            if layer_idx == cfg.candidate_source_layer_id:
                self.indexer.candidates = (cfg.candidate_block_size, cfg.candidate_topk_blocks)
            self.indexer.restricted = cfg.uses_candidates(layer_idx)

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """The layer's window ring (K only: K is V) and, on a kv source, its group's pools and open pair."""
        ring = self.formats.window
        spec: dict[str, CacheSpec] = {
            self.cache_name: WindowKV(
                num_kv_heads=1, head_dim=ring.width, dtype=ring.dtype, window=self.window, v_head_dim=0
            )
        }
        if self.compressor is not None:
            spec.update(self.compressor.cache_spec())
        return spec

    def forward(self, x: torch.Tensor, batch: ForwardBatch, flow: GroupFlow) -> torch.Tensor:
        rows = x.shape[0]
        q_resid = self.q_norm(self.wq_a(x))
        q = self.rotary.rotate(self.wq_b(q_resid).view(rows, self.num_heads, self.head_dim), batch.positions)
        kv = self.rotary.rotate(self.kv_norm(self.wkv(x))[:, None, :], batch.positions)[:, 0]
        kv = round_fp8_e8m0(kv)
        forms = packed_forms(self.formats)
        fused = use_triton(q) if self.fused_decode is None else self.fused_decode
        # the bounded decoder's window floors stay on the torch path
        if fused and forms is not None and batch.is_decode_only and not flow.window_floor:
            if self.ratio:
                self._select(x, q_resid, batch, flow, index_key_forms(self.formats), fused=True)
            out = packed_decode_attention(self, q, kv, batch, flow.selection, forms)
            return self._output(out, batch)
        stored = batch.cache.state[self.cache_name]["k"]
        slots = batch.state_slots.long()
        # torch path: the step's rings as values (one layer's, while it runs), packed back after its rows join
        ring = torch.zeros(*stored.shape[:-1], self.head_dim, dtype=self.dtype, device=stored.device)
        ring[slots] = self.formats.window.decode(stored[slots], self.dtype)
        latent = kv[:, None, :]  # one K/V head, read as both K and V
        lens = (batch.query_start_loc, batch.context_lens, batch.seq_lens)
        scale = self.head_dim**-0.5
        if not self.ratio:
            out = window_attention(
                q,
                latent,
                latent,
                ring,
                ring,
                batch.state_slots,
                *lens,
                self.attn_sink,
                scale,
                self.window,
                False,
            )
        else:
            self._select(x, q_resid, batch, flow)
            pool = batch.cache.kv[f"{self.source_name}.compressor"][0]
            out = sparse_window_attention_ref(
                q,
                kv,
                ring,
                pool,
                batch,
                self.attn_sink,
                scale,
                self.window,
                self.ratio,
                per_row_selection(flow.selection, batch),
                flow.window_floor,
                read_entries=lambda rows: self.formats.main.decode(rows, self.dtype),
            )
        ring_write(RingWriteInputs(latent, latent, ring, ring, batch.state_slots, *lens))
        stored[slots] = self.formats.window.encode(ring[slots]).to(stored.dtype)
        return self._output(out, batch)

    def _select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        batch: ForwardBatch,
        flow: GroupFlow,
        packed_keys: PackedKeyForms | None = None,
        fused: bool = False,
    ) -> None:
        """The group's entries this step completes (before anyone reads them), then the index source's picks
        (``packed_keys``: scored in the kernel that reads the packed keys; ``fused``: the fused decode path)."""
        if self.compressor is not None:
            self.compressor(x, batch, fused)
        if self.indexer is not None:
            keys = f"{self.source_name}.indexer"
            flow.selection = self.indexer(x, q_resid, batch, keys, self.ratio, flow, packed_keys)

    def _output(self, out: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        out = self.rotary.rotate(out, batch.positions, inverse=True)
        return grouped_output(self.wo_a, self.wo_b, out, self.groups, self.o_lora_rank)
