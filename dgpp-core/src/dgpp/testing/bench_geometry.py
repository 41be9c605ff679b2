"""What a plugin author checks an offered bench geometry with (``dgpp_bench_geometries``): the geometry's HF config
fields (``hf_config``; every offered one: ``geometries``), the family's model built from them (``new_model`` on
``meta`` counts a published model's parameters without allocating them; ``build_random_model`` fills them as
``dgpp bench`` does), the bytes a decode step reads (``weight_bytes_per_step``), and ``dgpp bench`` itself run in
this process (``run_bench(argv) -> exit status``)."""

from __future__ import annotations

from dgpp.bench.cli import main as run_bench
from dgpp.bench.models import build_random_model, geometries, hf_config, new_model, weight_bytes_per_step

__all__ = ["build_random_model", "geometries", "hf_config", "new_model", "run_bench", "weight_bytes_per_step"]
