"""Tiny random HF checkpoints, made with transformers itself, for every supported family.

Weights are random at a scale that gives O(1) logits; RMSNorm weights and q/k/v biases are
randomised too (not left at ones / zeros), so a mis-mapped norm or bias shows in the logits.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers

VOCAB = 96

_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the scaling changes the frequencies that 37 positions exercise
    "original_max_position_embeddings": 16,
}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.125,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    # Llama 2: multi-head attention, theta 1e4, no rope scaling, untied
    "llama2": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    ),
    # Llama 3.1: GQA, theta 5e5, llama3 rope scaling
    "llama3.1": (
        transformers.LlamaConfig,
        dict(rope_parameters={**_LLAMA3, "rope_theta": 5e5}),
    ),
    # Llama 3.2: like 3.1 with factor 32 and tied embeddings
    "llama3.2": (
        transformers.LlamaConfig,
        dict(
            rope_parameters={**_LLAMA3, "factor": 32.0, "rope_theta": 5e5},
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2: q/k/v bias, theta 1e6
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            use_sliding_window=False,
        ),
    ),
    # Mistral: GQA, theta 1e6, no sliding window (v0.2+)
    "mistral": (
        transformers.MistralConfig,
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None),
    ),
    # SmolLM2-like: llama, 3 heads / 1 kv head (not divisible by tp=2), tied, theta 1e5
    "smollm2": (
        transformers.LlamaConfig,
        dict(
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        ),
    ),
}


def hf_config(family: str, **changes):
    cls, extra = FAMILIES[family]
    return cls(**{**_COMMON, **extra, **changes})


def make_hf_model(family: str, *, seed: int = 0, **changes):
    """A random float32 HF causal LM of ``family`` (eager attention, eval mode); ``changes``
    override config fields."""
    torch.manual_seed(seed)
    cfg = hf_config(family, **changes)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def make_tokenizer():
    """A tiny word-level fast tokenizer over the fixture vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_hf_checkpoint(
    family: str,
    folder: pathlib.Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = False,
):
    """Save a random ``family`` model (safetensors) to ``folder``; returns the torch model."""
    model = make_hf_model(family, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if tokenizer:
        make_tokenizer().save_pretrained(folder)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def llamacpp_permute(weights, n_head: int, n_head_kv: int | None):
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(model, path: pathlib.Path, *, arch: str = "llama", types=None) -> pathlib.Path:
    """Write an HF model as a GGUF the way llama.cpp's converter does: llama.cpp tensor names,
    q/k rows permuted for ``llama`` (not for ``qwen2``), llama3 RoPE scaling as a ``rope_freqs``
    tensor of per-frequency divisors, no ``output.weight`` when tied. ``types`` maps a GGUF
    tensor name to its ``GGMLQuantizationType`` (default F32; 1-D tensors stay F32), quantized
    by the gguf package's own ``quants.quantize`` (Q8_1 has no quantizer there: its blocks are
    written as zero bytes)."""
    import math

    import gguf

    cfg = model.config
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", 10000.0))
    hd = cfg.head_dim
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    if rope.get("rope_type") == "llama3":  # llama.cpp's LlamaModel.generate_extra_tensors
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        factors = []
        for freq in 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)):
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    for name, p in model.state_dict().items():
        arr = p.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, i, *mod, kind = name.split(".")
            out = f"blk.{i}.{names['.'.join(mod)]}.{kind}"
            if arch == "llama" and mod[-1] in ("q_proj", "k_proj"):
                kv = cfg.num_attention_heads if mod[-1] == "q_proj" else cfg.num_key_value_heads
                arr = llamacpp_permute(arr, cfg.num_attention_heads, kv)
        kind = (types or {}).get(out, gguf.GGMLQuantizationType.F32) if arr.ndim == 2 else None
        if kind in (None, gguf.GGMLQuantizationType.F32):
            w.add_tensor(out, np.ascontiguousarray(arr))
            continue
        if kind == gguf.GGMLQuantizationType.Q8_1:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            data = np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8)
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(arr), kind)
        w.add_tensor(out, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_wide_llama(folder: pathlib.Path, *, hidden: int, intermediate: int, layers: int):
    """A Llama of random float32 weights with a tiny vocabulary but wide layers, written straight
    with safetensors (no torch model is built): a checkpoint large enough that converting it
    takes seconds."""
    from safetensors.numpy import save_file

    heads = hidden // 64
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    cfg.save_pretrained(folder)
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"}
        shapes |= {p + f"mlp.{n}_proj.weight": (intermediate, hidden) for n in ("gate", "up")}
        shapes[p + "mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    save_file(
        {k: rng.standard_normal(s, np.float32) for k, s in shapes.items()},
        str(folder / "model.safetensors"),
    )
    return folder


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM.from_linear, order_map


def awq_pack(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``[r, c]`` packed as AutoAWQ's GEMM layout does, written here from its
    definition (casper-hansen/AutoAWQ, awq/modules/linear/gemm.py, ``from_linear``): word
    column ``j`` holds column ``8j + AWQ_ORDER[i]`` in bits ``[4i, 4i + 4)``."""
    r, c = codes.shape
    words = np.zeros((r, c // 8), np.uint32)
    for j in range(c // 8):
        for i in range(8):
            words[:, j] |= codes[:, 8 * j + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
    return words.view(np.int32)


def write_awq(model, folder: pathlib.Path, *, group: int, seed: int = 0) -> dict:
    """Save an HF model as a 4-bit AWQ (GEMM) checkpoint: every decoder linear quantized
    asymmetrically in groups of ``group`` inputs (AutoAWQ's ``pseudo_quantize_tensor``: scale
    ``(max - min) / 15``, zero ``round(-min / scale)``), packed by ``awq_pack``; the rest float32.
    Returns ``{module: (codes [in, out], zeros [in / group, out], scales float16)}``."""
    from safetensors.numpy import save_file

    tensors, parts = {}, {}
    for name, p in model.state_dict().items():
        arr = p.detach().numpy().astype(np.float32)
        module = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and ".layers." in name):
            tensors[name] = arr
            continue
        w = arr.T  # [in, out]
        g = w.reshape(w.shape[0] // group, group, w.shape[1])
        lo, hi = g.min(axis=1), g.max(axis=1)
        scales = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
        zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 0, 15).astype(np.uint8)
        rep = np.repeat(scales.astype(np.float32), group, axis=0)
        codes = np.round(w / rep) + np.repeat(zeros, group, axis=0)
        codes = np.clip(codes, 0, 15).astype(np.uint8)
        tensors[f"{module}.qweight"] = awq_pack(codes)
        tensors[f"{module}.qzeros"] = awq_pack(zeros)
        tensors[f"{module}.scales"] = scales
        parts[module] = (codes, zeros, scales)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    # safetensors writes an array's buffer as it lies: only C-ordered arrays come back the same
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors")
    )
    return parts
