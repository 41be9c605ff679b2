"""SamplingParams: how one choice of one request picks its tokens (vLLM's name for it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgpp.errors import ConfigError

#: the smallest normal fp32; temperatures below it (0 included) are greedy
GREEDY_BELOW = 1.1754943508222875e-38


@dataclass(frozen=True)
class SamplingDefaults:
    """The checkpoint's preferred sampling values (``generation_config.json``), used when a request omits one."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_generation_config(cls, checkpoint_dir: str | Path | None) -> SamplingDefaults:
        """Read ``generation_config.json``. Absent keys keep OpenAI's defaults; ``do_sample: false`` makes the
        default greedy (temperature 0), as HF's ``generate`` would be for that checkpoint."""
        if checkpoint_dir is None:
            return cls()
        path = Path(checkpoint_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        base = cls()

        def number(key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
            value = raw.get(key)
            if value is None:  # null is how transformers writes an unset value
                return default
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not ((lo < value if lo_open else lo <= value) and value <= hi)
            ):
                bound = f"{'(' if lo_open else '['}{lo}, {hi}]"
                raise ConfigError(f"{path}: {key} must be a number in {bound}, got {value!r}")
            return float(value)

        greedy = raw.get("do_sample") is False
        return cls(
            temperature=0.0 if greedy else number("temperature", base.temperature, 0.0, 1e4),
            top_p=number("top_p", base.top_p, 0.0, 1.0),
            top_k=int(number("top_k", base.top_k, 0, 2**31)),
            min_p=number("min_p", base.min_p, 0.0, 1.0),
            repetition_penalty=number("repetition_penalty", base.repetition_penalty, 0.0, 1e4, lo_open=True),
        )

    def as_dict(self) -> dict[str, float | int]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides which token a choice emits next, plus its stop conditions.

    ``temperature == 0`` (or ``top_k == 1``) is greedy: the highest logit wins, ties go to the lowest id,
    and no random draw is consumed. A positive temperature below the smallest normal fp32 (``GREEDY_BELOW``)
    is greedy too: that is its limit, and fp32 cannot divide by it. ``seed`` makes sampled choices reproducible regardless of batching.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
