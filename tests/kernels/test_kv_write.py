"""The paged K/V write's torch form (``write_kv_ref``: the CUDA fallback and the ``DGPP_KERNELS=torch`` path)."""

import torch

from dgpp.kernels.kv_write import write_kv_ref


def test_a_key_only_entry_writes_its_keys_and_skips_the_empty_values():
    # DSA index keys are a K-only pool entry: V is [blocks, block_size, 1, 0]
    k_cache, v_cache = torch.zeros(4, 8, 1, 16), torch.zeros(4, 8, 1, 0)
    k = torch.randn(3, 1, 16)
    write_kv_ref(k_cache, v_cache, k, k[..., :0], torch.tensor([0, -1, 9]))
    flat = k_cache.view(-1, 1, 16)
    assert torch.equal(flat[0], k[0]) and torch.equal(flat[9], k[2])
    assert int((flat.abs().sum(dim=(1, 2)) > 0).sum()) == 2  # the slot of -1 wrote nothing
