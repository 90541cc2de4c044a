"""A jaxspec ``Model`` -> a transformers causal LM with the same weights (the inverse of
``weights.hf_to_tree``). The benchmark's HF peers run the very weights jaxspec runs: the target,
and the draft as HF's assistant model in assisted generation.

Tied embeddings stay tied (``tie_word_embeddings`` in the config, no separate ``lm_head``);
``Linear`` kernels are ``[in, out]`` here and ``[out, in]`` in HF, so they are transposed back.
Needs torch and transformers; nothing else in jaxspec imports this module.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxspec.config import ModelConfig
from jaxspec.errors import OptionError
from jaxspec.model.quantized import dequantize_params
from jaxspec.model.transformer import Model, param_shapes

_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def hf_config(cfg: ModelConfig):
    """The transformers config of the same architecture (eager attention)."""
    import transformers

    if cfg.family not in _CLASSES:
        raise OptionError(f"no HF export for the model family {cfg.family!r}.")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        _, factor, low, high, old = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": old,
        }
    extra = {}
    if cfg.family == "llama":
        extra = {"attention_bias": cfg.qkv_bias, "mlp_bias": False}
    elif cfg.family in ("mistral", "qwen2"):
        extra = {"sliding_window": None, "use_sliding_window": False}
    eos = list(cfg.eos_token_ids)
    hf = getattr(transformers, _CLASSES[cfg.family][0])(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        # HF checks the llama3 field against it; jaxspec caps the usable context separately
        max_position_embeddings=max(
            cfg.max_position_embeddings, cfg.rope_scaling[4] + 1 if cfg.rope_scaling else 0
        ),
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        **extra,
    )
    hf._attn_implementation = "eager"
    return hf


def state_dict(model: Model) -> dict[str, np.ndarray]:
    """HF tensor name -> float32 array, for every parameter of ``model`` (quantized weights
    dequantized: the float model they stand for)."""
    cfg = model.config
    pure = dequantize_params(nnx.to_pure_dict(model.params))
    out: dict[str, np.ndarray] = {}
    for path in param_shapes(cfg):
        node = pure
        for key in path:
            node = node[key]
        arr = np.asarray(node, dtype=np.float32)
        if path == ("embed_tokens",):
            out["model.embed_tokens.weight"] = arr
        elif path == ("norm", "weight"):
            out["model.norm.weight"] = arr
        elif path == ("lm_head", "kernel"):
            out["lm_head.weight"] = arr.T
        else:
            _, layer, *module, leaf = path
            name = f"model.layers.{layer}.{'.'.join(module)}"
            if leaf == "kernel":
                out[f"{name}.weight"] = arr.T
            else:  # "weight" of a norm, "bias" of a projection
                out[f"{name}.{leaf}"] = arr
    return out


def to_hf(model: Model, *, dtype=None, device: str = "cpu"):
    """A transformers ``*ForCausalLM`` (eval mode) holding ``model``'s weights.

    ``dtype``: a torch dtype (default: float32 for float32 models, else bfloat16).
    """
    import torch
    import transformers

    if dtype is None:
        dtype = torch.float32 if np.dtype(model.dtype) == np.float32 else torch.bfloat16
    cfg = hf_config(model.config)
    cls = getattr(transformers, _CLASSES[model.config.family][1])
    hf = cls(cfg)
    tensors = {k: torch.from_numpy(np.array(v, order="C")) for k, v in state_dict(model).items()}
    if model.config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"HF export mismatch: missing {missing}, unexpected {unexpected}")
    hf = hf.to(device=device, dtype=dtype)
    if model.config.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()
