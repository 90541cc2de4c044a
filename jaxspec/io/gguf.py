"""GGUF files: llama.cpp's tensor names and metadata as a ``ModelConfig``, its q/k row
permutation undone, llama3 RoPE scaling recovered from ``rope_freqs``, the tokenizer."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterator

import numpy as np

from jaxspec.config import ModelConfig, rope_inv_freq
from jaxspec.errors import CheckpointError
from jaxspec.io.hf import load_tokenizer

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF general.architecture -> (jaxspec family, whether llama.cpp permuted the q/k rows).
_GGUF_ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k weight (or bias).

    llama.cpp's converter (``LlamaModel.permute``) reorders each head's rows from HF's
    rotate-half layout (pairs (j, j + hd/2)) to interleaved pairs (2j, 2j+1)::

        w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)

    This is its inverse (as transformers' ``LlamaTensorProcessor``): ``n_head`` is the number
    of query heads for q and of key/value heads for k.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    def __init__(self, path: pathlib.Path):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
            self.by_name = {t.name: t for t in self.reader.tensors}
        except Exception as e:  # gguf raises ValueError, struct errors, IndexError, ...
            raise CheckpointError(
                f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is corrupt "
                "or truncated. Re-download it."
            ) from None
        arch = self._field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise CheckpointError(
                f"unsupported GGUF architecture {arch!r}; jaxspec converts GGUF architectures "
                f"{', '.join(sorted(_GGUF_ARCHS))} (Llama 2/3, Mistral, SmolLM2, Qwen2)."
            )
        self.arch = arch
        self.family, self.permuted = _GGUF_ARCHS[arch]

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: metadata {key} is unreadable ({e}); the file is corrupt."
            ) from None

    def _need(self, key: str):
        value = self._field(f"{self.arch}.{key}")
        if value is None:
            raise CheckpointError(
                f"{self.path} lacks the metadata {self.arch}.{key}; it is not a complete "
                f"{self.arch} GGUF."
            )
        return value

    def config(self) -> ModelConfig:
        heads = int(self._need("attention.head_count"))
        hidden = int(self._need("embedding_length"))
        head_dim = int(self._field(f"{self.arch}.attention.key_length") or hidden // heads)
        rope_dim = self._field(f"{self.arch}.rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != head_dim:
            raise CheckpointError(
                f"{self.path}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
                f"head_dim={head_dim}) are not supported."
            )
        scaling_type = self._field(f"{self.arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            raise CheckpointError(
                f"{self.path}: RoPE scaling {scaling_type!r} is not supported; jaxspec supports "
                "'llama3' scaling and none."
            )
        theta = float(self._field(f"{self.arch}.rope.freq_base") or 10000.0)
        emb = self.by_name.get("token_embd.weight")
        if emb is None:
            raise CheckpointError(f"{self.path} lacks token_embd.weight; the file is incomplete.")
        vocab = int(emb.shape[-1])  # ggml order: [hidden, vocab]
        rope_scaling = None
        freqs = self.by_name.get("rope_freqs.weight")
        if freqs is not None:
            rope_scaling = llama3_scaling_from_rope_freqs(
                np.asarray(self._dequantize(freqs), np.float64), theta, head_dim
            )
        eos = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            v = self._field(f"tokenizer.ggml.{key}")
            if v is not None and int(v) not in eos:
                eos.append(int(v))
        bos = self._field("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._need("feed_forward_length")),
            num_layers=int(self._need("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(f"{self.arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            max_position_embeddings=int(self._field(f"{self.arch}.context_length") or 4096),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(self._need("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.by_name,
            qkv_bias=self.family == "qwen2" or "blk.0.attn_q.bias" in self.by_name,
            family=self.family,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
        )

    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def _dequantize(self, t) -> np.ndarray:
        from gguf import quants

        try:
            return quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {t.name} uses the quantization {t.tensor_type.name}, "
                "which the gguf package cannot dequantize; use another quantization."
            ) from None
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: tensor {t.name} is unreadable ({type(e).__name__}: {e}); the "
                "file is corrupt or truncated."
            ) from None

    def tensors(self, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            arr = self._dequantize(t)
            if self.permuted and (".attn_q." in t.name or ".attn_k." in t.name):
                n = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
                if arr.shape[0] % (2 * n):
                    raise CheckpointError(
                        f"{self.path}: tensor {t.name} has {arr.shape[0]} rows, not a multiple "
                        f"of 2 x {n} heads; the file does not match its metadata."
                    )
                arr = unpermute_qk(arr, n)
            yield name, arr

    def tokenizer(self):
        if "tokenizer.ggml.tokens" not in self.reader.fields:
            return None
        try:
            return self._tokenizer_without_torch()
        except ImportError:  # another transformers layout: its own loader (needs torch)
            return load_tokenizer(str(self.path.parent), gguf_file=self.path.name)

    def _tokenizer_without_torch(self):
        """The tokenizer transformers builds from a GGUF, without its GGUF reader (which imports
        torch): the metadata comes from the ``gguf`` package, the construction is transformers'
        own ``convert_gguf_tokenizer``, so both spell the same tokenizer."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        def grouped(group):
            out = {}
            for key, name in GGUF_TOKENIZER_MAPPING[group].items():
                value = self._field(f"tokenizer.{key}")
                if value is not None:
                    out[name] = value
            return out

        tokenizer, config = grouped("tokenizer"), grouped("tokenizer_config")
        if tokenizer.get("tokenizer_type") == "llama":
            config.setdefault("add_bos_token", True)  # as transformers: older files lack it
        for name, key in _SPECIAL_TOKENS.items():
            token_id = self._field(f"tokenizer.ggml.{key}")
            config[name] = tokenizer["tokens"][int(token_id)] if token_id is not None else None
        try:
            fast, extra = convert_gguf_tokenizer(self.arch, tokenizer)
            return PreTrainedTokenizerFast(tokenizer_object=fast, **config, **extra)
        except ImportError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"the tokenizer in {self.path} could not be built ({type(e).__name__}: {e}); "
                "convert without it (tokenizer=False) and pass token ids."
            ) from None


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def llama3_scaling_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int) -> tuple:
    """Recover ModelConfig.rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores llama3 scaling as one divisor per frequency instead of its parameters.
    The scaling depends only on ``factor`` and the two wavelength bounds
    ``original_max_position_embeddings / low_freq_factor`` and ``... / high_freq_factor``;
    the parameters are recovered with ``low_freq_factor = 1`` (Meta's value) and checked by
    recomputing every divisor.
    """
    factors = np.asarray(factors, np.float64).reshape(-1)
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if factors.shape != inv.shape:
        raise CheckpointError(
            f"rope_freqs has {factors.size} entries, expected {inv.size} (head_dim/2)."
        )
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    wl = 2 * math.pi / inv
    high_band = np.isclose(factors, 1.0, rtol=1e-5)
    low_band = np.isclose(factors, factor, rtol=1e-5)
    mid = ~(high_band | low_band)
    candidates = [(1.0, 4.0, 8192)]  # Meta's Llama 3.1 / 3.2 values
    # smooth s = (old / wl - low) / (high - low); with low = 1: s = (old / wl - 1) / (high - 1)
    s = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    if mid.sum() >= 2:
        a, b = np.polyfit(1.0 / wl[mid], s[mid], 1)  # s = a / wl + b; a = old/(h-1), b = -1/(h-1)
        if b < 0:
            high = 1.0 - 1.0 / b
            candidates.append((1.0, high, round(a * (high - 1.0))))
    elif mid.sum() == 1:
        w0, s0 = wl[mid][0], s[mid][0]
        for high in (4.0, 2.0, 8.0):
            candidates.append((1.0, high, round(w0 * (s0 * (high - 1.0) + 1.0))))
    else:
        lo = wl[high_band].max() if high_band.any() else 0.0  # every high-band wl < old / high
        hi = wl[low_band].min() if low_band.any() else np.inf  # every low-band wl > old / low
        for high in (4.0, 2.0, 8.0):
            if lo * high < hi:
                top = hi if np.isfinite(hi) else lo * high * 2 + 2
                candidates.append((1.0, high, round((lo * high + top) / 2)))
    for low, high, old in candidates:
        if old <= 0:
            continue
        rs = ("llama3", factor, low, high, int(old))
        probe = ModelConfig(
            vocab_size=1,
            hidden_size=head_dim,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rs,
        )
        if np.allclose(inv / rope_inv_freq(probe), factors, rtol=1e-4):
            return rs
    raise CheckpointError(
        "the GGUF's rope_freqs tensor does not match llama3 RoPE scaling; this RoPE scaling "
        "is not supported."
    )
