"""Tiny random models and prompts shared by the engine tests."""

import dataclasses

import jax
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.model.transformer import Model, new_model

CFG = ModelConfig(
    vocab_size=67,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=1024,
)


def model(seed: int, cfg: ModelConfig = CFG, **changes) -> Model:
    return new_model(dataclasses.replace(cfg, **changes) if changes else cfg, seed=seed)


def perturbed(m: Model, scale: float, seed: int) -> Model:
    """The same model with relative noise on every weight: a draft that agrees partly."""
    leaves, tree = jax.tree.flatten(m.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x * (1 + scale * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys, strict=True)
    ]
    return dataclasses.replace(m, params=jax.tree.unflatten(tree, noisy))


def prompts(seed: int, lengths=(13, 2, 7), vocab: int = CFG.vocab_size) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    # repeated fragments give the n-gram draft something to find
    base = rng.randint(4, vocab, 6).tolist()
    return [(base * 4 + rng.randint(4, vocab, n).tolist())[-n:] for n in lengths]


def with_eos(m: Model, eos: int) -> Model:
    cfg = dataclasses.replace(m.config, eos_token_ids=(eos,))
    g, p = m.graphdef, m.params
    from flax import nnx

    module = nnx.merge(g, p)
    module.cfg = cfg
    for layer in module.layers:
        layer.self_attn.cfg = cfg
    g, p = nnx.split(module)
    return dataclasses.replace(m, config=cfg, graphdef=g, params=p)


# Head counts, MLP width and vocabulary that every tensor-parallel degree of the tests divides
# (1, 2, 4 and 6: SwiftSpec's 6 + 2 layout), with grouped-query attention (2 query heads a KV head)
TP = dict(num_heads=24, num_kv_heads=12, head_dim=4, intermediate_size=48, vocab_size=72)
