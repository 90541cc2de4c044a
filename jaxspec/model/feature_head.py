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

Why EAGLE-1's input by default: EAGLE-1's loss regresses the 576 numbers of the next state as
well as matching the next token, a dense signal per position that makes the most of a small
training budget (the shipped head trained in one 7-minute GPU call); it reads a single state, the
one the target's LM head already computes, so a verify returns one ``[b, t, d]`` array; and its
first draft step sees the target's exact state. EAGLE-3's other half, the training-time test (the
head trained on its own predicted states), is a training option of this head (``train.feature``,
``distill --ttt-steps``).

**Fused reads** (EAGLE-3's input, Li et al. 2025, arXiv 2503.01840): a head made with more
``reads`` than the final state (``distill --reads 1,14,final``: low and middle layers' outputs
beside it) maps the target's states at a position to one ``d``-wide state first: each layer's
output RMS-normalised (its own norm weight; the final state is normed already), the ``R``
states concatenated, then ``fuse`` (``R * d -> d``, no bias). The rest is the EAGLE-1 head:
``fc`` reads the fused state where the target has run and the head's own ``g`` after it, so the
reads must include the final state (``g`` is trained to stand in for it). A head widened from an
EAGLE-1 one (``widened``) starts with ``fuse`` picking the final state alone: it computes exactly
what the EAGLE-1 head did, and training opens the other layers from there.
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
from jaxspec.model.layers import Linear, RMSNorm, init_param, matmul, rope_tables, weight_of
from jaxspec.model.prefill import chunked, fit_chunk
from jaxspec.model.quantized import dequantize_params
from jaxspec.model.transformer import FINAL, DecoderLayer, Model, Net, Network

EAGLE1_READS = (FINAL,)  # the target states an EAGLE-1 head reads


def variant(reads) -> str:
    """The head's name in ``draft.json``: EAGLE-1's input or EAGLE-3's fused one."""
    return "eagle-1" if tuple(reads) == EAGLE1_READS else "eagle-3-fused"


class FeatureHead(nnx.Module):
    """``fc`` over ``[embed(token), feature]``, decoder ``layers``, the target's LM head; with
    fused ``reads``, ``fuse`` over the target's normed states first (the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, reads=EAGLE1_READS, dtype=jnp.float32, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.reads = tuple(reads)
        taps = [i for i in self.reads if i != FINAL]
        # an EAGLE-1 head's are None: it reads the final state alone
        self.read_norms = nnx.data(
            nnx.List([RMSNorm(d, cfg.rms_norm_eps, dtype) for _ in taps]) if taps else None
        )
        self.fuse = nnx.data(
            Linear(len(self.reads) * d, d, bias=False, dtype=dtype, rngs=rngs) if taps else None
        )
        self.embed_tokens = nnx.Param(init_param(rngs, (cfg.vocab_size, d), dtype))
        self.fc = Linear(2 * d, d, bias=True, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(d, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        self.vocab_head = None  # the LM head over the frequent tokens (``model.vocab_head``)

    def fused(self, states: Float[Array, "b t r"], kernels: KernelConfig) -> Float[Array, "b t d"]:
        """The target's states at ``reads`` (``transformer.apply``'s features, ``R * d`` wide)
        as the one ``d``-wide state ``fc`` reads: themselves for an EAGLE-1 head."""
        if self.fuse is None:
            return states
        parts = jnp.split(states, len(self.reads), axis=-1)
        norms = iter(self.read_norms)
        pairs = zip(self.reads, parts, strict=True)
        normed = [p if i == FINAL else next(norms)(p, kernels) for i, p in pairs]
        return self.fuse(jnp.concatenate(normed, axis=-1), kernels)

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


def fuse_states(net: Net, flat, states):
    """Pure ``FeatureHead.fused``: the target's states at the head's reads as ``fc``'s input."""
    return nnx.merge(net.graphdef, net.params(flat)).fused(states, net.kernels)


def head_prefill(net: Net, flat, cache: KVCache, ids, feats, lens) -> KVCache:
    """The head's cache over a prompt: pair t = ``(feats[:, t], ids[:, t + 1])`` at slot and
    position t, for ``t < lens - 1`` (the last prompt state pairs with the first new token, which
    the first draft step feeds), in the target's prefill chunks."""
    b, width = ids.shape
    feats = fuse_states(net, flat, feats)
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


def abstract_head(cfg: ModelConfig, dtype=jnp.float32, reads=EAGLE1_READS):
    """(graphdef, abstract params) of a head, without allocating weights: the loading template."""
    make = lambda: FeatureHead(cfg, reads=reads, dtype=dtype, rngs=nnx.Rngs(0))  # noqa: E731
    return nnx.split(nnx.eval_shape(make))


def shared_of(target: Model) -> dict:
    """The target's arrays a head uses as its own (embedding, LM head), as a pure dict; a
    quantized target's dequantized to its compute dtype (the head indexes and multiplies them
    as float arrays: a float copy of the embedding, the price of a quantized target's head)."""
    pure = nnx.to_pure_dict(target.params)
    shared = {k: pure[k] for k in ("embed_tokens", "lm_head") if pure.get(k) is not None}
    return dequantize_params(shared, target.dtype)


def head_model(
    target: Model, cfg: ModelConfig, own: dict, name: str, reads=EAGLE1_READS
) -> FeatureModel:
    """A ``FeatureModel`` of the head weights ``own`` (a pure dict without the shared arrays,
    cast to the target's dtype) over ``target``'s embedding and LM head."""
    dtype = target.dtype
    shared = shared_of(target)
    graphdef, state = abstract_head(cfg, dtype, reads)
    pure = {**jax.tree.map(lambda x: jnp.asarray(x, dtype), own), **shared}
    nnx.replace_by_pure_dict(state, pure)
    return FeatureModel(
        cfg, graphdef, state, target.tokenizer, name=name, kernels=target.kernels,
        reads=tuple(reads),
    )  # fmt: skip


def random_head(target: Model, *, layers: int = 1, intermediate: int | None = None,
                seed: int = 0, reads=EAGLE1_READS) -> FeatureModel:  # fmt: skip
    """A head with random weights for ``target`` (tests; the start of training)."""
    cfg = head_config(target.config, layers, intermediate or target.config.intermediate_size)
    module = FeatureHead(cfg, reads=reads, dtype=target.dtype, rngs=nnx.Rngs(seed))
    own = {k: v for k, v in nnx.to_pure_dict(nnx.state(module)).items() if k not in SHARED}
    return head_model(target, cfg, own, f"random-feature-head[{layers}L]", reads)


def parse_reads(text: str, num_layers: int) -> tuple[int, ...]:
    """``distill --reads``: comma-separated layer indices (a layer's output, 0-based) and
    ``final`` (the final norm's output), e.g. ``1,14,final``; the final state must be among
    them (the module docstring). ``OptionError`` names what is wrong."""
    reads = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if item == "final":
            reads.append(FINAL)
        elif item.isdigit() and int(item) < num_layers:
            reads.append(int(item))
        else:
            raise OptionError(
                f"reads={text!r}: {item!r} is neither 'final' nor a layer index of the "
                f"target's 0..{num_layers - 1}; pass e.g. reads='1,{num_layers // 2},final'."
            )
    if FINAL not in reads or len(set(reads)) != len(reads):
        raise OptionError(
            f"reads={text!r} must name 'final' once and each layer at most once: the head "
            "feeds its own predicted final state back in place of the target's."
        )
    return tuple(reads)


def widened(own: dict, fresh: dict, reads) -> dict:
    """An EAGLE-1 head's weights ``own`` given the fused reads of ``fresh`` (a random head of
    the wanted reads, ``reads``): ``fresh``'s read norms, and a ``fuse`` that passes the final
    state through and gives the other layers weight zero. The widened head computes exactly
    what ``own`` did; training opens the other layers through ``fuse``, whose gradients there
    are not zero."""
    d = fresh["fc"]["bias"].shape[0]
    kernel = jnp.zeros((len(reads) * d, d), fresh["fc"]["bias"].dtype)
    at = list(reads).index(FINAL) * d
    kernel = kernel.at[at : at + d].set(jnp.eye(d, dtype=kernel.dtype))
    return {**own, "read_norms": fresh["read_norms"], "fuse": {"kernel": kernel}}


SHARED = ("embed_tokens", "lm_head")  # taken from the target: never stored, never trained


def head_config(target_cfg: ModelConfig, layers: int, intermediate: int) -> ModelConfig:
    """The head's config: the target's shapes with ``layers`` decoder layers of MLP width
    ``intermediate``."""
    return dataclasses.replace(target_cfg, num_layers=layers, intermediate_size=intermediate)
