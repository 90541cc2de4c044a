"""ModelConfig: the static, hashable description of a decoder-only transformer.

Covers Llama 2, Llama 3 / 3.1 / 3.2 (``llama3`` RoPE scaling), Qwen2 / 2.5 (q/k/v bias), Mistral
and SmolLM2 (tied embeddings). Built from an HF ``config.json`` dict or from GGUF metadata.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from jaxspec.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    family: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; the checkpoint's config is inconsistent."
            )

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        d["rope_scaling"] = tuple(d["rope_scaling"]) if d.get("rope_scaling") else None
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF ``config.json``."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        family = SUPPORTED_ARCHITECTURES.get(arch) or (
            hf.get("model_type")
            if hf.get("model_type") in SUPPORTED_ARCHITECTURES.values()
            else None
        )
        if family is None:
            raise CheckpointError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; jaxspec converts "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
            )
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            rope_theta = hf.get("rope_theta")
            rope = hf.get("rope_scaling") or hf.get("rope_parameters")
            if rope_theta is None and isinstance(rope, dict):
                rope_theta = rope.get("rope_theta")
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                max_position_embeddings=_usable_context(hf),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=_rope_scaling_from_hf(rope),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
                family=family,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the field {e.args[0]!r}") from None


def _usable_context(hf: dict) -> int:
    """The context jaxspec can decode exactly: attention here is full (no sliding window), so a
    Mistral-style ``sliding_window`` caps it; past the window the model would attend differently.
    """
    ctx = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    use_window = hf.get("use_sliding_window", True)
    if window and use_window and int(window) < ctx:
        return int(window)
    return ctx


def _rope_scaling_from_hf(rope: dict | None) -> tuple | None:
    if not rope:
        return None
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise CheckpointError(
            f"RoPE scaling {kind!r} is not supported; jaxspec supports 'llama3' and none."
        )
    return (
        "llama3",
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2], float64 on the host, with llama3 scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if cfg.rope_scaling is None:
        return inv
    _, factor, low, high, old_ctx = cfg.rope_scaling
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)
