"""Shared pieces of the Qwen3.5 hybrid tests: tiny random checkpoints saved by transformers, loading them
through the plugin, and a small step driver that turns ``SeqWork`` lists into ``ForwardBatch`` es."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dgpp.engine.batch import ForwardBatch
from dgpp.engine.pools import CachePools
from dgpp.family import LoadContext
from dgpp.sched.work import SeqWork

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    initializer_range=0.08,  # larger than the default so logits are far from zero and greedy picks are clear
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    eos_token_id=None,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
KINDS = ("dense", "moe", "dense_wrapper", "moe_wrapper")


def build_hf_model(kind: str, seed: int = 0):
    """A tiny transformers model of ``kind`` with every norm and GDN parameter randomised (the
    initialiser leaves norms at identity, which would hide a wrong norm form)."""
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(TEXT, **(MOE if kind.startswith("moe") else {}))
    if kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    elif kind == "moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text))
    elif kind == "dense_wrapper":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=VISION))
    elif kind == "moe_wrapper":
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=text, vision_config=VISION))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    return model.eval()


def save_checkpoint(model, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(path)
    return path


def load_dgpp(path: Path):
    """Load through the plugin hook, as the engine does."""
    from dgpp.plugins import manager, resolve

    hf_config = json.loads((path / "config.json").read_text())
    pm = manager()
    res = resolve(pm, hf_config)
    arch = (hf_config.get("architectures") or [res.matched])[0]
    ctx = LoadContext(checkpoint_dir=path, hf_config=hf_config, family=res.family.name, architecture=arch)
    return pm.hook.dgpp_load_model(ctx=ctx)


class StepDriver:
    """Builds one ``ForwardBatch`` per ``step`` from ``SeqWork`` s over engine-style pools.

    Returns fp32 logits for the last row of each work that wants them, or for every row with ``all_rows``."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 8, num_slots: int = 8) -> None:
        self.model = model
        self.block_size = block_size
        self.pools = CachePools(model.cache_spec(), num_blocks, block_size, num_slots)

    def step(self, works: list[SeqWork], all_rows: bool = False) -> torch.Tensor:
        bs = self.block_size
        ids, positions, slots, logit_rows = [], [], [], []
        start = 0
        for w in works:
            n = len(w.token_ids)
            pos = list(range(w.context_len, w.context_len + n))
            ids += w.token_ids
            positions += pos
            slots += [w.block_table[p // bs] * bs + p % bs for p in pos]
            if all_rows:
                logit_rows += list(range(start, start + n))
            elif w.want_logits:
                logit_rows.append(start + n - 1)
            start += n
        q_lens = [len(w.token_ids) for w in works]
        ctx = [w.context_len for w in works]
        seq_lens = [c + q for c, q in zip(ctx, q_lens)]
        width = max(len(w.block_table) for w in works)
        tables = torch.full((len(works), width), -1, dtype=torch.int32)
        for i, w in enumerate(works):
            tables[i, : len(w.block_table)] = torch.tensor(w.block_table, dtype=torch.int32)
        qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            state_slots=torch.tensor([w.state_slot for w in works], dtype=torch.int64),
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64),
            cache=self.pools,
            q_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx,
        )
        with torch.no_grad():
            return self.model.compute_logits(self.model(batch)).float()


def blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def greedy(driver: StepDriver, prompts: list[list[int]], new_tokens: int, chunk: int | None = None) -> list[list[int]]:
    """All prompts together: prefill (in ``chunk``-token pieces when given, every prompt in each step), then
    ``new_tokens`` batched greedy decode steps. Sequence ``i`` uses slot ``i`` and its own 24 blocks."""
    tables = [blocks(24 * i, 24) for i in range(len(prompts))]
    done = [0] * len(prompts)
    logits = {}
    while any(d < len(p) for d, p in zip(done, prompts)):
        works, live = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                works.append(SeqWork(i, tables[i], done[i], p[done[i] : done[i] + n]))
                live.append(i)
                done[i] += n
        for i, row in zip(live, driver.step(works)):
            logits[i] = row
    outs = [[int(logits[i].argmax())] for i in range(len(prompts))]
    for _ in range(new_tokens - 1):
        works = [SeqWork(i, tables[i], len(p) + len(o) - 1, [o[-1]]) for i, (p, o) in enumerate(zip(prompts, outs))]
        for o, row in zip(outs, driver.step(works)):
            o.append(int(row.argmax()))
    return outs
