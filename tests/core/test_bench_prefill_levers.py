"""``dgpp bench prefill-levers --model '' --fixtures``: one row per lever and packed tiny checkpoint, each with a
nonzero logit error (the lever acted) far below the logits' size."""

from __future__ import annotations

from dgpp.bench.cli import main


def test_fixture_rows_report_a_nonzero_bounded_error(tmp_path, capsys):
    out = tmp_path / "levers.md"
    assert main(["prefill-levers", "--model", "", "--fixtures", "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| prefill_")]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| prefill_fp8_gemm", "qwen3 (fp8)"],
        ["| prefill_bf16_partials", "qwen3_moe (modelopt)"],
        ["| prefill_bf16_partials", "qwen3_5_moe (modelopt)"],
    ]
    for row in rows:
        largest, mean = (float(cell) for cell in row.strip(" |").split(" | ")[2:4])
        assert 0 < mean <= largest < 0.25, row
    assert "commit" in out.read_text().splitlines()[0]
