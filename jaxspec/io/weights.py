"""HF tensor names -> jaxspec parameter tree. Shared by the safetensors and GGUF converters.

A tensor is a float array in HF's orientation, or a ``QuantizedWeight`` that a reader kept
quantized, already in ours (``[in, out]``; an embedding ``[D, V]``, see
``jaxspec.model.quantized``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError
from jaxspec.model.quantized import EMBEDDING
from jaxspec.model.transformer import param_shapes
from pallas_kernels import quant

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# HF Linear weights are [out, in]; our kernels are [in, out].
_LINEARS = {
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
}
_NORMS = {"input_layernorm", "post_attention_layernorm"}


def param_path(name: str) -> tuple[tuple, bool] | None:
    """Our path for an HF tensor name, and whether it must be transposed; None: not used."""
    if name == "model.embed_tokens.weight":
        return ("embed_tokens",), False
    if name == "model.norm.weight":
        return ("norm", "weight"), False
    if name == "lm_head.weight":
        return ("lm_head", "kernel"), True
    m = _LAYER.match(name)
    if not m:
        return None
    layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
    if module in _LINEARS:
        leaf = "kernel" if kind == "weight" else "bias"
        return ("layers", layer, *module.split("."), leaf), kind == "weight"
    if module in _NORMS and kind == "weight":
        return ("layers", layer, module, "weight"), False
    return None


def _unsupported_bias(name: str, module: str) -> CheckpointError:
    if module in ("q_proj", "k_proj", "v_proj"):
        return CheckpointError(
            f"the checkpoint has the bias {name}, but its config declares no q/k/v biases "
            "(attention_bias is false); its config.json does not match its weights."
        )
    return CheckpointError(
        f"the checkpoint has the bias {name}, which jaxspec does not support: it runs biases on "
        "q_proj, k_proj and v_proj only (as Qwen2 has them), not on o_proj or the MLP, so this "
        "model cannot be converted."
    )


def hf_to_tree(
    tensors: Iterable[tuple[str, object]],
    cfg: ModelConfig,
    dtype,
    quantize: Callable[[tuple, np.ndarray], object] | None = None,
) -> dict:
    """Build the nested parameter dict from (HF name, tensor) pairs, checking every shape.
    Float arrays are cast to ``dtype``; quantized weights keep their codes and scales and
    compute in ``dtype``. ``quantize(path, array)``, where given, quantizes float arrays (or
    returns them) before the cast."""
    want = param_shapes(cfg)
    flat: dict[tuple, object] = {}
    for name, arr in tensors:
        found = param_path(name)
        if found is None:
            continue
        path, transpose = found
        if path == ("lm_head", "kernel") and cfg.tie_word_embeddings:
            continue
        if path not in want and path[-1] == "bias":
            raise _unsupported_bias(name, path[-2])
        if quant.is_quantized(arr):  # in our orientation already; an embedding as [D, V]
            shape = arr.shape[::-1] if path == EMBEDDING else arr.shape
        else:
            arr = np.asarray(arr)
            arr = arr.T if transpose else arr
            shape = arr.shape
        if path not in want or tuple(shape) != want[path]:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(shape)}, expected "
                f"{want.get(path, 'no such tensor')} for this config; the checkpoint is corrupt "
                "or its config.json does not match its weights."
            )
        if quantize is not None and not quant.is_quantized(arr):
            arr = quantize(path, arr)
        flat[path] = arr.astype(dtype)
    missing = [".".join(map(str, p)) for p in want if p not in flat]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensors (first: {missing[0]}); it is "
            "incomplete or corrupt. Re-download or re-export it."
        )
    tree: dict = {}
    for path, arr in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = arr
    return tree
