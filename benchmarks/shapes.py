"""Model shapes the benchmarks build with random weights (public configs of the named models)."""

from __future__ import annotations

import dataclasses

from jaxspec.config import ModelConfig

LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
# Llama-3-70B (SwiftSpec's headline target): 80 layers, 64 query / 8 KV heads
LLAMA3_70B = dataclasses.replace(
    LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64
)
# Llama-3.1-8B: the same layers with a 128K context (its llama3 RoPE scaling changes no step time)
LLAMA31_8B = dataclasses.replace(LLAMA3_8B, max_position_embeddings=131072)
LLAMA32_1B = dataclasses.replace(
    LLAMA3_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    head_dim=64,
    tie_word_embeddings=True,
)
SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
# tiny shapes for CPU checks of the scripts
SMOKE = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
SMOKE_DRAFT = dataclasses.replace(
    SMOKE, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2
)
