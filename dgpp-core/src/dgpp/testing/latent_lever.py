"""``engine.kv_dtype`` fp8 / fp4 on a family with MLA latent caches (and DSA index keys), as pytest checks to
subclass beside ``FamilyConformance``: ``class TestGlm5Latent(LatentKVLever)`` with the module's ``fp32_pair``.

Every check of ``KVFp8Lever`` (bounded nonzero logit move, batched == alone, chunked == one-shot, mixed == solo,
prefix hit == cold) runs under both formats, and the pools are checked for the stored forms: latents as e4m3
codes (fp8) or packed ``fp4_row_bytes`` rows (fp4) with one fp32 row scale, ``k_rot`` in the compute dtype, index
keys as e4m3 rows with a row scale under either.
"""

from __future__ import annotations

import pytest
import torch

from dgpp.offline import make_pools
from dgpp.step.cache_spec import KV_FP8, LatentKV, PagedKV, fp4_row_bytes
from dgpp.testing.suite import KVFp8Lever


class LatentKVLever(KVFp8Lever):
    """``KVFp8Lever``'s checks under ``fp8`` and ``fp4`` for a model whose quantized entries are MLA latents and
    index keys; ``kv_fp4_*`` bound the fp4 logit move as ``kv_fp8_*`` bound fp8's. More rows may jump than under
    GQA fp8: a key that rounds across a neighbour's score changes a DSA selection, and with it the whole row."""

    kv_fp8_outlier_rows: float = 0.35
    kv_fp8_worst_bound: float = 1.0
    kv_fp4_row_bound: float = 0.4
    kv_fp4_outlier_rows: float = 0.3
    kv_fp4_worst_bound: float = 1.0

    test_kv_fp8_pools_hold_one_byte_codes_and_row_scales = None  # GQA's form; latents are checked below

    @pytest.fixture(name="kv_lever_dtype", params=["fp8", "fp4"])
    def kv_lever_dtype_fixture(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    def lever_bounds(self, kv_dtype: str) -> tuple[float, float, float]:
        if kv_dtype == "fp4":
            return self.kv_fp4_row_bound, self.kv_fp4_outlier_rows, self.kv_fp4_worst_bound
        return super().lever_bounds(kv_dtype)

    def test_latent_and_index_pools_hold_codes_and_row_scales(self, fp32_pair, kv_lever_dtype):
        model, _ = fp32_pair
        pools, _, _ = make_pools(model, [32], 16, kv_lever_dtype)
        latents = [(n, s) for n, s in model.cache_spec().items() if isinstance(s, LatentKV)]
        index_keys = [n for n, s in model.cache_spec().items() if isinstance(s, PagedKV) and s.index_keys]
        assert latents and index_keys
        for name, spec in latents:
            latent, k_rot = pools.kv[name]
            if kv_lever_dtype == "fp8":
                assert latent.dtype == KV_FP8 and latent.shape[-1] == spec.latent_dim, name
            else:
                assert latent.dtype == torch.uint8 and latent.shape[-1] == fp4_row_bytes(spec.latent_dim), (
                    name
                )
            assert k_rot.dtype == spec.dtype and k_rot.shape[-1] == spec.rope_dim, name
            scale, empty = pools.kv_scales[name]
            assert (
                scale.dtype == torch.float32 and scale.shape == (*latent.shape[:3], 1) and empty.numel() == 0
            )
        for name in index_keys:
            keys, no_v = pools.kv[name]
            scale, empty = pools.kv_scales[name]
            assert keys.dtype == KV_FP8 and no_v.numel() == 0 and empty.numel() == 0, name
            assert scale.shape == (*keys.shape[:3], 1), name
        exact, _, _ = make_pools(model, [32], 16)
        assert pools.kv_bytes() < exact.kv_bytes()
