"""Cache specs where plugins import them from: what ``Model.cache_spec()`` returns (defined in
``dgpp.step.cache_spec``)."""

from __future__ import annotations

from dgpp.step.cache_spec import CacheSpec, CompressedKV, LatentKV, PagedKV, StateSpec, WindowBuffer, WindowKV

__all__ = ["CacheSpec", "CompressedKV", "LatentKV", "PagedKV", "StateSpec", "WindowBuffer", "WindowKV"]
