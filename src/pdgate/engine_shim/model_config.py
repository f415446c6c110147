"""Llama-family model geometry parsed from an HF `config.json`.

The shim runs exactly one architecture (Llama: RMSNorm, RoPE, GQA attention, SwiGLU MLP, no
biases), so anything a checkpoint declares that this implementation would silently compute
wrong (rope scaling, biases, another activation, another architecture) is rejected here, at
load time, with a message naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
SUPPORTED_DTYPES = frozenset({"float32", "float16", "bfloat16"})

_REQUIRED_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelConfig:
    """Validated geometry of a Llama checkpoint; built by `from_dict` / `from_file`.

    `eos_token_ids` (HF `eos_token_id`) is a tuple: configs may list several stop ids.
    `dtype` is the checkpoint's declared dtype name ("float32" | "float16" | "bfloat16").
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (*_REQUIRED_INTS, "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"model config: dtype {self.dtype!r} not in {sorted(SUPPORTED_DTYPES)}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("model config: rms_norm_eps and rope_theta must be > 0")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Parse `path` (a config.json, or a model directory containing one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"model config: {p} not found")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model config: {p} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"model config: {p} must hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate an HF config dict; raises ValueError naming the offending field."""
        _check_architecture(raw)
        missing = [k for k in _REQUIRED_INTS if k not in raw]
        if missing:
            raise ValueError(f"model config: missing required field(s) {missing}")
        ints = {k: _as_int(raw, k) for k in _REQUIRED_INTS}
        heads = ints["num_attention_heads"]
        kv_heads = _as_int(raw, "num_key_value_heads", heads)
        head_dim = _as_int(raw, "head_dim", ints["hidden_size"] // heads)
        return cls(
            **ints,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=_as_int(raw, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=_opt_int(raw, "bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            dtype=_dtype(raw),
        )


def _check_architecture(raw: dict[str, Any]) -> None:
    archs = raw.get("architectures") or []
    if archs and not SUPPORTED_ARCHITECTURES.intersection(archs):
        raise ValueError(
            f"model config: unsupported architectures {archs}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if not archs and raw.get("model_type") != "llama":
        raise ValueError(
            f"model config: unsupported model_type {raw.get('model_type')!r} "
            "(no architectures listed); only Llama checkpoints are supported"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model config: hidden_act {raw['hidden_act']!r} unsupported (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"model config: {flag}=true is not supported")
    if raw.get("rope_scaling") is not None:
        raise ValueError(
            f"model config: rope_scaling {raw['rope_scaling']!r} is not supported "
            "(only plain RoPE; rope_scaling must be null)"
        )


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers >= 5 nests RoPE settings under `rope_parameters`; older configs keep a
    # top-level `rope_theta`. Accept both, but only the default (unscaled) rope type.
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError("model config: rope_parameters must be an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"model config: rope_parameters.rope_type {rope_type!r} is not supported "
                "(only 'default')"
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def _dtype(raw: dict[str, Any]) -> str:
    value = raw.get("torch_dtype", raw.get("dtype")) or "float32"
    if not isinstance(value, str):
        raise ValueError(f"model config: torch_dtype must be a string, got {value!r}")
    return value.removeprefix("torch.")


def _as_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model config: {key} must be an integer, got {value!r}")
    return value


def _opt_int(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    return None if value is None else _as_int(raw, key)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"model config: eos_token_id must be an int or list of ints: {value!r}")
    return tuple(items)
