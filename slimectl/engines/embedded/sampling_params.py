"""SGLang's sampling parameters for the embedded engine: the subset it implements, validated, and read from a
``sampling_params`` object (parameters it does not implement are accepted only at their neutral value)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# Temperatures below this are treated as greedy decoding (SGLang's _SAMPLING_EPS).
GREEDY_EPS = 1e-6

# SGLang sampling parameters we accept but do not implement, with the value that means "off".
# Any other value is refused (we would silently sample from a different distribution otherwise).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# SGLang parameters that only affect streaming / detokenization details: accepted, ignored.
_IGNORED_KEYS = {"spaces_between_special_tokens", "stream_interval"}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """SGLang-compatible sampling parameters (the subset this engine implements)."""

    max_new_tokens: int | None = 128  # None => up to the model's context length
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0 => off
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)  # matched on the decoded output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) for values we cannot honour."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise ValueError(f"max_new_tokens must be a non-negative integer or null, got {self.max_new_tokens!r}")
        if not is_num(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.sampling_seed is not None and not is_int(self.sampling_seed):
            raise ValueError(f"sampling_seed must be an integer or null, got {self.sampling_seed!r}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from an SGLang ``sampling_params`` object.

        Parameters SGLang knows but this engine does not implement are accepted at their neutral
        value (e.g. ``repetition_penalty: 1.0``) and refused otherwise; unknown keys are refused.
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        own = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in own:
                kwargs[key] = value
            elif key in _IGNORED_KEYS:
                continue
            elif key in _UNSUPPORTED_DEFAULTS:
                neutral = _UNSUPPORTED_DEFAULTS[key]
                if value is not None and value != neutral and not (key == "custom_params" and value == {}):
                    raise ValueError(f"{key}={value!r} is not supported by the embedded engine (only {neutral!r})")
            else:
                raise ValueError(f"unknown sampling parameter {key!r}")
        # SGLang sends null for "not set" on most fields: fall back to our defaults.
        for key in ("temperature", "top_p", "top_k", "min_p", "ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if key in kwargs and kwargs[key] is None:
                del kwargs[key]
        if isinstance(kwargs.get("temperature"), int) and not isinstance(kwargs.get("temperature"), bool):
            kwargs["temperature"] = float(kwargs["temperature"])
        if "stop" in kwargs and isinstance(kwargs["stop"], str):
            kwargs["stop"] = [kwargs["stop"]]
        return cls(**kwargs)
