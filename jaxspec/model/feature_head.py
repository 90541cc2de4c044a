"""The network of a feature draft (EAGLE-1, Li et al. 2024, arXiv 2401.15077): a small head that
predicts the target's next hidden state from its current one.

Input at position t: the pair ``(f_t, x_{t+1})``, where ``f_t`` is the target's final hidden
state (its final norm's output: what its LM head reads, ``transformer.FINAL``) after token t and
``x_{t+1}`` the token that followed. ``z = fc([embed(x_{t+1}), f_t])`` (``2d -> d``, with a
bias), then ``layers`` decoder layers of the target's shape (one in EAGLE-1) with their own
KV cache, give ``g_{t+1}``: the head's estimate of ``f_{t+1}``. The target's own LM head turns
it into the distribution of ``x_{t+2}``; there is no final norm, since ``f`` is already the
normed state. The head shares the target's embedding and LM head (filled from the target when
loaded, frozen in training); while drafting ahead of the target it feeds ``g`` back in place of
``f`` (``spec.feature_drafts``).

Why EAGLE-1's input and not EAGLE-3's (fused low, middle and high layers): EAGLE-1's loss
regresses the 576 numbers of the next state as well as matching the next token, a dense signal
per position that makes the most of a small training budget (the shipped head trained in one
7-minute GPU call); it reads a single state, the one the target's LM head already computes, so a
verify returns one ``[b, t, d]`` array; and its first draft step sees the target's exact state.
EAGLE-3's gains come with far more training data than that budget writes. The target-side API
(``apply(..., features=...)``) reads any layers, so an EAGLE-3 head could be added beside this
one. EAGLE-3's other half, the training-time test (the head trained on its own predicted
states), is a training option of this head (``train.feature``, ``distill --ttt-steps``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxspec.config import ModelConfig
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.model.kv_cache import Block, KVCache
from jaxspec.model.layers import Linear, init_param, matmul, rope_tables, weight_of
from jaxspec.model.prefill import chunked, fit_chunk
from jaxspec.model.quantized import dequantize_params
from jaxspec.model.transformer import FINAL, DecoderLayer, Model, Net, Network

EAGLE1_READS = (FINAL,)  # the target states an EAGLE-1 head reads


class FeatureHead(nnx.Module):
    """``fc`` over ``[embed(token), feature]``, decoder ``layers``, the target's LM head."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = nnx.Param(init_param(rngs, (cfg.vocab_size, d), dtype))
        self.fc = Linear(2 * d, d, bias=True, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(d, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        self.vocab_head = None  # the LM head over the frequent tokens (``model.vocab_head``)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        feats: Float[Array, "b t d"],
        cache: KVCache,
        block: Block,
        select: Int[Array, "b l"] | None,
        kernels: KernelConfig,
        subset: bool = False,
    ) -> tuple[Float[Array, "b l v"], Float[Array, "b l d"], KVCache]:
        """Logits (float32) and the predicted next states ``g`` at ``select`` (all T if None),
        and the cache with the block's K/V written (``cache.length`` unchanged). ``subset``: a
        cut head's logits over its subset only (``transformer.apply``)."""
        e = self.embed_tokens[...][tokens]
        x = self.fc(jnp.concatenate([e, feats.astype(e.dtype)], axis=-1), kernels)
        cos, sin = rope_tables(self.cfg, block.positions)
        ks, vs = [], []
        for layer, kc, vc in zip(self.layers, cache.k, cache.v, strict=True):
            x, kc, vc = layer(x, cos, sin, kc, vc, cache.length, block, kernels)
            ks.append(kc)
            vs.append(vc)
        if select is not None:
            x = jnp.take_along_axis(x, select[..., None], axis=1)
        if self.vocab_head is not None:
            return self.vocab_head(x, kernels, subset), x, KVCache(k=ks, v=vs, length=cache.length)
        head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
        logits = matmul(x, head, kernels.gemm_rows, jnp.float32)
        return logits, x, KVCache(k=ks, v=vs, length=cache.length)


def apply_head(
    net: Net, flat, tokens, feats, cache: KVCache, block: Block, select=None, subset=False
):
    """Pure forward of the feature head ``net`` describes: ``(logits, g, cache)``; ``subset``
    as ``transformer.apply``'s."""
    module = nnx.merge(net.graphdef, net.params(flat))
    return module(tokens, feats, cache, block, select, net.kernels, subset)


def head_prefill(net: Net, flat, cache: KVCache, ids, feats, lens) -> KVCache:
    """The head's cache over a prompt: pair t = ``(feats[:, t], ids[:, t + 1])`` at slot and
    position t, for ``t < lens - 1`` (the last prompt state pairs with the first new token, which
    the first draft step feeds), in the target's prefill chunks."""
    b, width = ids.shape
    chunk = fit_chunk(width, net.kernels.prefill_tokens(b, net.dtype))
    nxt = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))
    zero = jnp.zeros((b, 1), jnp.int32)

    def forward(cache, acc, start, valid, block):
        tok = jax.lax.dynamic_slice_in_dim(nxt, start, chunk, axis=1)
        f = jax.lax.dynamic_slice_in_dim(feats, start, chunk, axis=1)
        return apply_head(net, flat, tok, f, cache, block, zero)[2], acc

    cache, _ = chunked(forward, cache, jnp.maximum(lens - 1, 0), width, chunk, ())
    return cache


@dataclasses.dataclass(eq=False, repr=False)
class FeatureModel(Network):
    """A loaded feature head (``jaxspec.load_draft`` of a ``--kind feature`` distill): pass it
    as ``draft=`` with its target. ``reads``: the target states it takes (``apply``'s
    ``features``). ``params`` hold the target's embedding (and LM head), shared, not copied."""

    reads: tuple[int, ...] = EAGLE1_READS

    @property
    def dtype(self):
        """The compute dtype: ``fc``'s (a head has no final norm; its own weights are never
        quantized, and ``head_model`` casts them to the target's compute dtype)."""
        return weight_of(self.params["fc"]["bias"]).dtype

    def __repr__(self) -> str:
        return f"FeatureModel({self.name!r}, layers={self.config.num_layers}, reads={self.reads})"

    def logits(self, tokens):
        raise OptionError(
            "a feature draft predicts from the target's hidden states and has no logits of its "
            "own; pass it as draft= to jaxspec.generate with its target."
        )


def abstract_head(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract params) of a head, without allocating weights: the loading template."""
    return nnx.split(nnx.eval_shape(lambda: FeatureHead(cfg, dtype=dtype, rngs=nnx.Rngs(0))))


def shared_of(target: Model) -> dict:
    """The target's arrays a head uses as its own (embedding, LM head), as a pure dict; a
    quantized target's dequantized to its compute dtype (the head indexes and multiplies them
    as float arrays: a float copy of the embedding, the price of a quantized target's head)."""
    pure = nnx.to_pure_dict(target.params)
    shared = {k: pure[k] for k in ("embed_tokens", "lm_head") if pure.get(k) is not None}
    return dequantize_params(shared, target.dtype)


def head_model(target: Model, cfg: ModelConfig, own: dict, name: str) -> FeatureModel:
    """A ``FeatureModel`` of the head weights ``own`` (a pure dict without the shared arrays,
    cast to the target's dtype) over ``target``'s embedding and LM head."""
    dtype = target.dtype
    shared = shared_of(target)
    graphdef, state = abstract_head(cfg, dtype)
    pure = {**jax.tree.map(lambda x: jnp.asarray(x, dtype), own), **shared}
    nnx.replace_by_pure_dict(state, pure)
    return FeatureModel(cfg, graphdef, state, target.tokenizer, name=name, kernels=target.kernels)


def random_head(target: Model, *, layers: int = 1, intermediate: int | None = None,
                seed: int = 0) -> FeatureModel:  # fmt: skip
    """A head with random weights for ``target`` (tests; the start of training)."""
    cfg = head_config(target.config, layers, intermediate or target.config.intermediate_size)
    module = FeatureHead(cfg, dtype=target.dtype, rngs=nnx.Rngs(seed))
    own = {k: v for k, v in nnx.to_pure_dict(nnx.state(module)).items() if k not in SHARED}
    return head_model(target, cfg, own, f"random-feature-head[{layers}L]")


SHARED = ("embed_tokens", "lm_head")  # taken from the target: never stored, never trained


def head_config(target_cfg: ModelConfig, layers: int, intermediate: int) -> ModelConfig:
    """The head's config: the target's shapes with ``layers`` decoder layers of MLP width
    ``intermediate``."""
    return dataclasses.replace(target_cfg, num_layers=layers, intermediate_size=intermediate)
