"""The Flax NNX decoder-only transformer (Llama / Mistral / Qwen2 / SmolLM2 families).

One forward serves every engine: ``apply(net, params, tokens, cache, block) -> (logits, cache)``,
where ``block`` (``kv_cache.Block``) says each token's RoPE position, the cache slot its K/V go
to, and which block slots it may attend to. Prefill, decode, chain verify, tree verify and
draft-tree expansion are all this one call with different blocks.

At run time a ``Model`` is split once into (graphdef, parameter state); its leaves are flattened
once (``Model.flat``), and programs take the flat leaves plus a ``Net``: the static, hashable
description of the model a program is compiled for (graph, config, resolved ``KernelConfig``,
leaf structure, tensor-parallel layout), hashed once. NNX traversal happens only while tracing.
Weights on a tensor-parallel mesh run through GSPMD or, with ``KernelConfig(tensor_parallel=
"shard_map")``, through the explicit step of ``tensor_parallel`` (the same modules per device).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxspec.config import ModelConfig
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.model import tensor_parallel
from jaxspec.model.attention import Attention
from jaxspec.model.kv_cache import Block, KVCache, causal_block, init_cache
from jaxspec.model.layers import (
    MLP,
    Linear,
    RMSNorm,
    embed_rows,
    init_param,
    mode_of,
    project,
    rope_tables,
    stream_rows,
    tokens_of,
    weight_of,
)
from jaxspec.prompts import check_token_ids
from pallas_kernels import fused_linear, quant, rope_attention

FINAL = -1  # ``features`` index of the final norm's output: the LM head's input


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        abstract = rngs is None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, abstract=abstract)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, abstract=abstract
        )
        self.mlp = MLP(cfg, dtype, rngs)

    def fused_mode(self, x, kernels: KernelConfig) -> str | None:
        """The split-K projection kernels' mode for this step (None: the plain path)."""
        mode = mode_of(kernels.fused_linear)
        if mode is None:
            return None
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > kernels.linear_rows:
            return None
        wq, wk, wv, _, wg, wu, _ = self.weights()  # the ones that take the stream's rows
        return mode if fused_linear.unsupported_reason(rows, wq, wk, wv, wg, wu) is None else None

    def weights(self) -> tuple:
        """q, k, v, o, gate, up, down: arrays or ``QuantizedWeight``s (the fused kernels take
        both)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        return tuple(weight_of(lin.kernel) for lin in linears)

    def __call__(self, x, cos, sin, k_cache, v_cache, length, block, kernels, parallel=None):
        """``parallel``: the explicit tensor-parallel step's ``Collectives`` (None: one device),
        which sums the row-parallel o_proj's and down's partials over the devices."""
        reduce = (lambda y: y) if parallel is None else parallel.reduce
        h, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x, kernels), cos, sin, k_cache, v_cache, length, block, kernels
        )
        x = x + reduce(h)
        x = x + reduce(self.mlp(self.post_attention_layernorm(x, kernels), kernels))
        return x, k_cache, v_cache

    def fused(self, x, pending, cos, sin, k_cache, v_cache, length, block, kernels, mode: str):
        """The same layer through the split-K projection kernels (few rows: decode and verify
        steps). ``x [M, d]`` is the residual stream before the previous layer's down projection
        is added, ``pending`` that projection's float32 partials (None before the first layer);
        returns this layer's ``(x, pending, k_cache, v_cache)``."""
        b, t = cos.shape[:2]
        attn, cfg = self.self_attn, self.self_attn.cfg
        wq, wk, wv, wo, wg, wu, wd = self.weights()
        bn, bk, warps, *qkv_bk = kernels.linear_tile
        tiles = dict(interpret=mode == "interpret", bn=bn, bk=bk, num_warps=warps)
        # Q/K/V's own K split (KernelConfig.linear_tile's fourth entry): its partials are what
        # the fused attention kernel sums in every program
        qkv_tiles = {**tiles, "bk": qkv_bk[0]} if qkv_bk and qkv_bk[0] else tiles
        # one row: the norms and the attention's merge in the projection kernels; more (a
        # verify): once each in XLA, not in every program (fused_linear.norm_then_project)
        one_row = x.shape[0] == 1
        fl = fused_linear.norm_project if one_row else fused_linear.norm_then_project
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x, qkv = fl(x, pending, ln1.weight[...], (wq, wk, wv), eps=ln1.eps, **qkv_tiles)
        fl = functools.partial(fl, **tiles)
        qkv = qkv.reshape(qkv.shape[0], b, t, -1, cfg.head_dim)
        out, k_cache, v_cache = attn.attend(
            qkv, cos, sin, k_cache, v_cache, length, block, kernels, splits=one_row
        )
        if isinstance(out, rope_attention.Splits):  # o_proj merges the splits as it loads
            o = fused_linear.combine_project(*out, wo, t=t, **tiles)
        else:
            o = fused_linear.project(out.reshape(b * t, -1), (wo,), **tiles)
        x, gate_up = fl(x, o, ln2.weight[...], (wg, wu), eps=ln2.eps)
        down = fused_linear.silu_project(gate_up, wd, **tiles)
        return x, down, k_cache, v_cache


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        """``rngs=None``: an abstract model, every parameter a ``jax.ShapeDtypeStruct``."""
        self.cfg = cfg
        self.embed_tokens = nnx.Param(init_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, abstract=rngs is None)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        self.vocab_head = None  # a draft's head over its frequent tokens (``model.vocab_head``)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        cache: KVCache,
        block: Block,
        select: Int[Array, "b l"] | None,
        kernels: KernelConfig,
        features: tuple[int, ...] | None = None,
        parallel: tensor_parallel.Collectives | None = None,
        subset: bool = False,
    ):
        """Logits (float32) at ``select`` positions of the block (all T if None), and the cache
        with this block's K/V written. ``cache.length`` is unchanged: the caller commits. With
        ``features`` (see ``apply``) also the hidden states they name at every block position.
        ``parallel``: one device's part of the explicit tensor-parallel step (its vocabulary
        slice of the embedding and of the logits, its heads). ``subset``: a cut head's logits over
        its subset only (see ``apply``)."""
        b, t = tokens.shape
        table = weight_of(self.embed_tokens)
        x = embed_rows(table, tokens) if parallel is None else parallel.embed(table, tokens)
        mode = self.layers[0].fused_mode(x, kernels)  # the split-K kernels take this step
        rows = stream_rows(b * t, kernels) if mode is None else None
        if rows is not None:  # the residual stream as padded rows [rows, d]
            x = jnp.pad(x.reshape(b * t, -1), ((0, rows - b * t), (0, 0)))
        cos, sin = rope_tables(self.cfg, block.positions)
        ks, vs, taps = [], [], {}
        layers = zip(self.layers, cache.k, cache.v, strict=True)
        if mode is not None:  # the split-K projection kernels: rows [b * t, d] and partials
            x, pending = x.reshape(b * t, -1), None
            for i, (layer, kc, vc) in enumerate(layers):
                x, pending, kc, vc = layer.fused(
                    x, pending, cos, sin, kc, vc, cache.length, block, kernels, mode
                )
                ks.append(kc)
                vs.append(vc)
                if features is not None and i in features:
                    taps[i] = fused_linear.settle(x, pending)
            x = fused_linear.settle(x, pending)
        else:
            for i, (layer, kc, vc) in enumerate(layers):
                x, kc, vc = layer(x, cos, sin, kc, vc, cache.length, block, kernels, parallel)
                ks.append(kc)
                vs.append(vc)
                if features is not None and i in features:
                    taps[i] = x
        x = tokens_of(x, b, t, -1)
        cache = KVCache(k=ks, v=vs, length=cache.length)
        logits = self._logits(x, select, kernels, subset)
        if features is None:
            return logits, cache
        taps = {i: tokens_of(y, b, t, -1) for i, y in taps.items()}
        taps[FINAL] = self.norm(x, kernels)  # what the LM head reads, at every position
        return logits, cache, jnp.concatenate([taps[i] for i in features], axis=-1)

    def _logits(self, x, select, kernels: KernelConfig, subset=False) -> Float[Array, "b l v"]:
        if select is not None:
            x = jnp.take_along_axis(x, select[..., None], axis=1)
        x = self.norm(x, kernels)
        if self.vocab_head is not None:
            return self.vocab_head(x, kernels, subset)
        w, stored = self.head()
        return project(x, w, kernels, jnp.float32, w_out_in=stored)

    def head(self):
        """The LM head and whether it is ``[V, D]`` (else ``[D, V]``). Float32 logits come
        straight from its accumulator: rounding them to bf16 made exact top-2 ties common, and
        greedy then depends on the kernel's tie order (seen on the H200). Tied: the dense
        embedding ``[V, D]`` as stored (``x @ E.T`` made XLA's CPU backend copy the transposed
        table at every step), or a quantized one, stored as ``[D, V]`` already."""
        if self.lm_head is not None:
            return weight_of(self.lm_head.kernel), False
        table = weight_of(self.embed_tokens)
        return table, not quant.is_quantized(table)


@dataclasses.dataclass(frozen=True, eq=False)
class Net:
    """What a compiled program knows of a model: its NNX graph, config, resolved kernels, the
    structure of its flat parameter leaves (quantized weights' formats included), its compute
    dtype (of activations and the KV cache) and how its leaves lie over a tensor-parallel mesh
    (``tp``; None: one device, or a mesh the explicit step does not take). Static and hashable;
    the hash is computed once, since a compile-cache or jit key must not walk the NNX graph on
    every call."""

    graphdef: nnx.GraphDef
    cfg: ModelConfig
    kernels: KernelConfig
    treedef: object  # of the parameter state's leaves (``Model.flat``)
    dtype: str = "float32"
    tp: tensor_parallel.TensorParallel | None = None

    def __post_init__(self):
        key = (hash(self.graphdef), self.cfg, self.kernels, self.treedef, self.dtype, self.tp)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Net) or self._hash != other._hash:
            return False
        return (self.cfg, self.kernels, self.treedef, self.dtype, self.tp) == (
            other.cfg,
            other.kernels,
            other.treedef,
            other.dtype,
            other.tp,
        ) and self.graphdef == other.graphdef

    def params(self, flat):
        """The parameter state from its flat leaves (trace time)."""
        return jax.tree.unflatten(self.treedef, flat)

    def with_kernels(self, kernels: KernelConfig) -> Net:
        return Net(self.graphdef, self.cfg, kernels, self.treedef, self.dtype, self.tp)


def apply(
    net: Net, flat, tokens, cache: KVCache, block: Block, select=None, features=None, subset=False
):
    """Pure forward of the model ``net`` describes, on its flat parameter leaves ``flat``
    (merged at trace time). Call inside a jit. Returns ``(logits, cache)``.

    ``features`` (static): a tuple of layer indices whose hidden states a feature draft reads;
    then the call returns ``(logits, cache, feats [b, t, len(features) * d])``, the states at
    every block position concatenated in that order: index i >= 0 is the residual stream after
    decoder layer i, ``FINAL`` (-1) the final norm's output (what the LM head reads). Only a
    call that asks traces them; the logits are computed the same way either way.

    ``subset`` (static): a draft whose head is cut to a subset of the vocabulary
    (``model.vocab_head``) returns its logits over that subset only, ``[b, l, K]``, with no
    scatter into the whole vocabulary; read them through ``vocab_head.top_log_probs`` and
    ``vocab_head.argmax``. Without a cut head, or under the explicit tensor-parallel step, it
    changes nothing.

    Under the explicit tensor-parallel step the logits come split over the vocabulary: read
    them through ``tensor_parallel.argmax`` and its kin (the features are whole)."""
    if tensor_parallel.active(net):
        return tensor_parallel.forward(net, flat, tokens, cache, block, select, features)
    module = nnx.merge(net.graphdef, net.params(flat))
    feats = None if features is None else tuple(features)
    return module(tokens, cache, block, select, net.kernels, feats, subset=subset)


def embed(net: Net, flat, tokens):
    """The token embeddings ``[..., d]`` (trace time)."""
    return embed_rows(weight_of(net.params(flat)["embed_tokens"]), tokens)


class Layout(tuple):
    """(shape, dtype, sharding) of every weight leaf: the weights' part of a compile-cache key.
    Its hash is computed once (a key is hashed at every call)."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h

    def __eq__(self, other) -> bool:
        return self is other or tuple.__eq__(self, other)

    __ne__ = object.__ne__


@dataclasses.dataclass(frozen=True, eq=False)
class Weights:
    """A model's parameter leaves, flattened once, and their ``Layout``."""

    flat: list
    layout: Layout
    treedef: object

    @functools.cached_property
    def sharded(self) -> bool:
        """Whether the leaves are laid out over several devices (tensor parallel)."""
        return any(len(getattr(s, "device_set", ())) > 1 for _, _, s in self.layout)

    @functools.cached_property
    def tp(self) -> tensor_parallel.TensorParallel | None:
        """How the leaves lie over a 1-D tensor-parallel mesh (None: they do not)."""
        return tensor_parallel.layout_of(s for _, _, s in self.layout)


def weights_of(params) -> Weights:
    leaves, treedef = jax.tree.flatten(params)
    layout = Layout(
        (tuple(x.shape), jnp.dtype(x.dtype).name, getattr(x, "sharding", None)) for x in leaves
    )
    return Weights(leaves, layout, treedef)


@dataclasses.dataclass(eq=False)
class Network:
    """A loaded network: static config, NNX graphdef, parameter state, optional tokenizer, and
    the ``KernelConfig`` it runs with unless a call names another (None: the defaults); its
    flat weights and ``Net``s, derived once. A ``Model`` (a decoder that runs on its own) or a
    feature draft's head (``model.feature_head.FeatureModel``, which reads a target's states)."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: object | None = None
    name: str = ""
    kernels: KernelConfig | None = None
    # not an init field: ``dataclasses.replace(model, params=...)`` makes a model whose derived
    # values start empty (sharing them made two models evict each other's on every call)
    _cache: dict = dataclasses.field(default_factory=dict, repr=False, init=False)

    @property
    def dtype(self):
        """The compute dtype (activations, KV cache): a norm's, which is never quantized (the
        final norm; a feature head has none, so its first layer's input norm)."""
        p = self.params
        norm = p["norm"] if "norm" in p else p["layers"][0]["input_layernorm"]
        return weight_of(norm["weight"]).dtype

    @property
    def weights(self) -> Weights:
        """The parameter leaves, flattened once per ``params`` object (programs take flat
        leaves: an NNX State costs milliseconds to flatten at every call)."""
        got = self._cache.get("weights")
        if got is None or got[0] is not self.params:
            if got is not None:  # new parameter arrays: what was derived from the old goes
                self._cache.clear()
            got = self._cache["weights"] = (self.params, weights_of(self.params))
        return got[1]

    @property
    def flat(self) -> list:
        return self.weights.flat

    @property
    def layout(self) -> Layout:
        return self.weights.layout

    def net(self, kernels: KernelConfig | None = None, *, sharded: bool | None = None) -> Net:
        """The ``Net`` of this model with ``kernels`` (default: its own, else the defaults)
        resolved for its size and this backend; cached per setting."""
        want = kernels or self.kernels or KernelConfig()
        w = self.weights
        spans = w.sharded if sharded is None else sharded
        key = ("net", want, spans)
        net = self._cache.get(key)
        if net is None:
            resolved = want.resolve(self.config, sharded=spans)
            dtype = jnp.dtype(self.dtype).name
            tp = w.tp if spans else None
            net = Net(self.graphdef, self.config, resolved, w.treedef, dtype, tp)
            self._cache[key] = net
        return net


@dataclasses.dataclass(eq=False)
class Model(Network):
    """A decoder-only language model (``Transformer``): what ``generate`` takes as the target
    and as a draft."""

    def logits(self, tokens) -> Float[Array, "b t v"]:
        """Full causal forward without a persistent cache: ``[B, T]`` ids -> ``[B, T, V]``."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        check_token_ids(tokens, self.config)
        return _full_logits(self, self.net(), tokens)


def _full_logits(model: Model, net: Net, tokens):
    """``full_logits`` compiled once per (net, shape), kept with the model."""
    key = ("logits", net, tokens.shape)
    exe = model._cache.get(key)
    if exe is None:
        lowered = jax.jit(full_logits, static_argnums=0).lower(net, model.flat, tokens)
        exe = lowered.compile(compiler_options=net.kernels.compiler_options())
        model._cache[key] = exe
    return exe(model.flat, tokens)


def full_logits(net: Net, flat, tokens, features=None):
    """Full causal forward ``[B, T]`` -> float32 logits ``[B, T, V]`` with a throwaway cache (the
    same call every engine makes); a pure function to use inside a jit. With ``features``
    (``apply``'s), ``(logits, states [B, T, f])``."""
    b, t = tokens.shape
    cache, block = whole_block(net.cfg, b, t, net.dtype)
    logits, _, *feats = apply(net, flat, tokens, cache, block, None, features)
    return logits if features is None else (logits, feats[0])


def whole_block(cfg: ModelConfig, b: int, t: int, dtype) -> tuple[KVCache, Block]:
    """A throwaway cache of ``t`` slots and the causal block of ``t`` tokens from position 0:
    a whole sequence in one forward."""
    zeros = jnp.zeros((b,), jnp.int32)
    block = causal_block(zeros, zeros, jnp.full((b,), t, jnp.int32), t)
    return init_cache(cfg, b, t, dtype), block


def param_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    """Every parameter's path (as ``nnx.to_pure_dict`` nests it) and shape."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {("embed_tokens",): (cfg.vocab_size, d), ("norm", "weight"): (d,)}
    if not cfg.tie_word_embeddings:
        out[("lm_head", "kernel")] = (d, cfg.vocab_size)
    for i in range(cfg.num_layers):
        p = ("layers", i)
        out[(*p, "input_layernorm", "weight")] = (d,)
        out[(*p, "post_attention_layernorm", "weight")] = (d,)
        for name, shape in (("q_proj", (d, q)), ("k_proj", (d, kv)), ("v_proj", (d, kv))):
            out[(*p, "self_attn", name, "kernel")] = shape
            if cfg.qkv_bias:
                out[(*p, "self_attn", name, "bias")] = (shape[1],)
        out[(*p, "self_attn", "o_proj", "kernel")] = (q, d)
        out[(*p, "mlp", "gate_proj", "kernel")] = (d, f)
        out[(*p, "mlp", "up_proj", "kernel")] = (d, f)
        out[(*p, "mlp", "down_proj", "kernel")] = (f, d)
    return out


def new_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32, tokenizer=None) -> Model:
    """A model with random weights (tests, benchmarks of model shapes)."""
    module = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(module)
    return Model(cfg, graphdef, params, tokenizer, name=f"random-{cfg.family}")


def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract params) without allocating weights: the template for loading. Built
    with ``rngs=None`` rather than traced (``nnx.eval_shape`` of the random init took 0.36 s of
    a warm `jaxspec generate` on the 2-core CPU for SmolLM2's 30 layers)."""
    return nnx.split(Transformer(cfg, dtype=dtype, rngs=None))


def with_params(model: Model, params: nnx.State, **changes) -> Model:
    """``model`` with other parameter arrays (same structure), e.g. placed on a mesh."""
    return dataclasses.replace(model, params=params, **changes)


def truncate(model: Model, num_layers: int) -> Model:
    """The first ``num_layers`` decoder layers of ``model`` with its final norm and head: a
    small draft that shares the target's tokenizer and embeddings with no training (an early
    exit, as in LayerSkip). The arrays are shared with ``model``, not copied."""
    if not (1 <= num_layers <= model.config.num_layers):
        raise OptionError(
            f"num_layers must be in [1, {model.config.num_layers}], got {num_layers}."
        )
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    pure = nnx.to_pure_dict(model.params)
    pure["layers"] = {i: pure["layers"][i] for i in range(num_layers)}
    graphdef, state = abstract_model(cfg, model.dtype)
    nnx.replace_by_pure_dict(state, pure)
    return Model(
        cfg, graphdef, state, model.tokenizer, name=f"{model.name}[:{num_layers}]",
        kernels=model.kernels,
    )  # fmt: skip
