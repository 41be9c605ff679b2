"""Tensor parallelism over 2 CPU processes (gloo): each rank loads its slice of the same checkpoint
through the per-parameter weight loaders; the reduced logits equal the single-rank model's. Also with the
residual stream a GPU runs (each add fused into the next RMSNorm by the Triton kernel, here under the
interpreter on CPU tensors): the row-parallel reductions must still happen."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dgpp.family import World
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint

PROMPT_LENGTHS = (5, 11)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with_fused_kernel(model, prompts) -> tuple[list[torch.Tensor], int]:
    """Logits with ``add_rms_norm`` taking its Triton kernel (the CUDA dispatch) on CPU tensors, and how many
    fused add+norm launches the forwards made."""
    from dgpp.kernels import rmsnorm

    launches = 0
    kernel, rule = rmsnorm.rms_norm_triton, rmsnorm.use_triton

    def counted(x, weight, eps, residual=None, *numerics):
        nonlocal launches
        launches += residual is not None
        return kernel(x, weight, eps, residual, *numerics)

    rmsnorm.use_triton, rmsnorm.rms_norm_triton = (lambda x: True), counted
    try:
        return conf.engine_all_logits(model, prompts), launches
    finally:
        rmsnorm.use_triton, rmsnorm.rms_norm_triton = rule, kernel


def _rank_main(rank: int, size: int, port: int, path: str, out: str, fused: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        model = load_model(path, world=World(rank=rank, size=size), group=dist.group.WORLD)
        prompts = conf.make_prompts(512, PROMPT_LENGTHS, seed=3)
        result = run_with_fused_kernel(model, prompts) if fused else conf.engine_all_logits(model, prompts)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_two_rank_tensor_parallel_matches_one_rank(tmp_path):
    # one checkpoint covers every sliced kind of layer: biased q/k/v (column) and o (row, bias added
    # once), a dense SwiGLU layer (mlp_only_layers) and a routed-expert layer
    overrides = {"attention_bias": True, "mlp_only_layers": [0]}
    path = build_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=4, overrides=overrides)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), str(path), str(out)), nprocs=2, join=True)
    sharded = torch.load(out)
    whole = conf.engine_all_logits(load_model(path), conf.make_prompts(512, PROMPT_LENGTHS, seed=3))
    for a, b in zip(sharded, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_residual_path_reduces_under_two_rank_tensor_parallel(tmp_path):
    overrides = {"attention_bias": True, "mlp_only_layers": [0]}
    path = build_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=4, overrides=overrides)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), str(path), str(out), True), nprocs=2, join=True)
    sharded, launches = torch.load(out)
    whole = load_model(path)
    # one forward: per layer the attention add (into post_attention_layernorm) and the MLP add (into the next
    # layer's input norm, or the final norm)
    assert launches == 2 * len(whole.model.layers)
    reference = conf.engine_all_logits(whole, conf.make_prompts(512, PROMPT_LENGTHS, seed=3))
    for a, b in zip(sharded, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
