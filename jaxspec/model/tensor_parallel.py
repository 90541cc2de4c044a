"""The explicit tensor-parallel step (``KernelConfig(tensor_parallel="shard_map")``).

A model whose weights lie on a 1-D mesh of N devices along the axis ``"tp"`` (``sharding.place``:
the Megatron layout) runs its forward as one ``jax.shard_map`` over that mesh, each device on its
own shard, with exactly these collectives:

- the embedding, split over the vocabulary: each device looks its rows up (zeros elsewhere) and
  one all-reduce sums them (exact: one term is not zero);
- per layer, column-parallel Q/K/V and gate/up (each device its heads, its MLP columns),
  attention over its heads with the KV cache sharded by KV heads, row-parallel o_proj and down:
  one all-reduce after attention, one after the MLP (``all_reduce``: ``KernelConfig.all_reduce``);
- the LM head, split over the vocabulary: each device returns its logits ``[b, t, V / N]``,
  which are never gathered on the greedy path: ``argmax`` all-gathers one (max, index) pair per
  device and row, ``sample`` is Gumbel-max (the same argmax after adding Gumbel noise, which a
  shared key draws for the whole vocabulary and each device computes for its slice only: exact
  for temperature sampling), ``top_log_probs`` (a tree draft's children) all-gathers each
  device's top k and its log-sum-exp terms. Rules that need whole distributions (speculative
  sampling, top-k / top-p) ``gather`` the logits: one all-gather, written.

So a decode step of L layers has 2L + 1 all-reduces and one all-gather (the tests count them in
the compiled HLO): nothing is left to the partitioner's propagation. Prefill
chunks are blocks like any other and take the same step. The cache commits of the engines run
outside the step, on the head-sharded cache (slot gathers and scatters: no collective).

Inside the step each device runs the one-device modules (``Transformer.__call__`` with the
``Collectives`` hook), with its attention modules' config cut to the local heads, so the
attention kernels (and the fused RoPE + attention kernel) take a device's heads unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from jaxspec import ranking
from jaxspec.config import ModelConfig
from jaxspec.errors import OptionError
from jaxspec.model.kv_cache import Block, KVCache
from jaxspec.model.layers import embed_rows
from pallas_kernels import all_reduce as all_reduce_kernels
from pallas_kernels import quant

AXIS = "tp"
KV_SPEC = PartitionSpec(None, None, AXIS, None)  # [B, S, KH, hd]: split by KV heads


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How a model's flat weight leaves lie over a 1-D ``"tp"`` mesh: its size and each leaf's
    PartitionSpec (static and hashable: part of a ``Net``)."""

    degree: int
    specs: tuple


def layout_of(shardings) -> TensorParallel | None:
    """The ``TensorParallel`` of weight leaves with these shardings (None: not over several
    devices, or not on one 1-D ``"tp"`` mesh: such weights run through GSPMD)."""
    degree, specs = None, []
    for s in shardings:
        devices = len(getattr(s, "device_set", ()))
        if devices <= 1:
            specs.append(PartitionSpec())
            continue
        if not isinstance(s, NamedSharding) or tuple(s.mesh.axis_names) != (AXIS,):
            return None
        if degree not in (None, devices):
            return None
        degree = devices
        specs.append(s.spec)
    return None if degree is None else TensorParallel(degree, tuple(specs))


def active(net) -> bool:
    """Whether ``net`` (a ``transformer.Net``) runs the explicit step."""
    return net.tp is not None and net.kernels.tensor_parallel == "shard_map"


@functools.cache
def mesh(degree: int) -> AbstractMesh:
    """The step's mesh, abstract: the devices are those the arguments lie on, so one program
    serves any N devices (SwiftSpec's target on [0, x), its draft on [x, x + y))."""
    return AbstractMesh((degree,), (AXIS,), axis_types=(AxisType.Auto,))


def local_config(cfg: ModelConfig, degree: int) -> ModelConfig:
    """The config of one device's shard: its heads, MLP columns and vocabulary slice."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // degree,
        num_kv_heads=cfg.num_kv_heads // degree,
        intermediate_size=cfg.intermediate_size // degree,
        vocab_size=cfg.vocab_size // degree,
    )


def all_reduce(x: Float[Array, "..."], how: str, degree: int) -> Float[Array, "..."]:
    """The sum of ``x`` over the step's devices: "psum" (XLA's all-reduce), "oneshot" (the
    Mosaic GPU kernel where it takes the message, else psum), "oneshot_reference",
    "interpret" (the one-shot remote-DMA kernel through Pallas' interpreter)."""
    if how == "oneshot_reference":
        return all_reduce_kernels.reference(x, AXIS)
    if how == "interpret":
        return all_reduce_kernels.oneshot_dma(x, axis_name=AXIS, num_devices=degree)
    if how == "oneshot" and all_reduce_kernels.unsupported_reason(x, degree) is None:
        return all_reduce_kernels.oneshot(x, axis_name=AXIS, num_devices=degree)
    return lax.psum(x, AXIS)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """What a device's decoder does across devices (``Transformer.__call__``'s ``parallel``)."""

    degree: int
    how: str  # KernelConfig.all_reduce

    def reduce(self, x):
        return all_reduce(x, self.how, self.degree)

    def embed(self, table, tokens: Int[Array, "b t"]):
        """Rows of the vocabulary-split embedding (a dense ``[V / N, d]`` slice, or a quantized
        table's ``[d, V / N]`` columns): this device's rows, zeros elsewhere, summed over
        devices (exact: one term is not zero)."""
        rows = table.shape[1] if quant.is_quantized(table) else table.shape[0]
        local = tokens - lax.axis_index(AXIS) * rows
        mine = (local >= 0) & (local < rows)
        got = embed_rows(table, jnp.clip(local, 0, rows - 1))
        return self.reduce(jnp.where(mine[..., None], got, 0).astype(got.dtype))


def cache_spec(cache: KVCache):
    """The cache's specs: K/V split by KV heads, lengths on every device."""
    return jax.tree.map(lambda x: KV_SPEC if x.ndim == 4 else PartitionSpec(), cache)


def forward(net, flat, tokens, cache: KVCache, block: Block, select, features=None):
    """``transformer.apply`` as the explicit step: ``(logits [b, l, V] split over the vocabulary,
    cache split by KV heads[, features])``; the features (a feature draft's states) are the
    replicated residual stream, whole on every device. Call inside a jit, on weights laid out as
    ``net.tp`` says."""
    n = net.tp.degree
    parallel = Collectives(n, net.kernels.all_reduce)
    cfg = local_config(net.cfg, n)
    feats = None if features is None else tuple(features)

    def step(flat, tokens, cache, block, *select):
        module = nnx.merge(net.graphdef, net.params(flat))
        for layer in module.layers:  # the attention modules see this device's heads
            layer.self_attn.cfg = cfg
            for lin, rows in ((layer.self_attn.o_proj, cfg.num_heads * cfg.head_dim),
                              (layer.mlp.down_proj, cfg.intermediate_size)):  # fmt: skip
                lin.kernel.set_value(_local_rows(lin.kernel.get_value(), rows))
        sel = select[0] if select else None
        out = module(tokens, cache, block, sel, net.kernels, feats, parallel)
        if module.vocab_head is None:
            return out
        # a draft's head over its frequent tokens is replicated: its whole-vocabulary logits,
        # this device's slice of them
        width = net.cfg.vocab_size // n
        part = lax.dynamic_slice_in_dim(out[0], lax.axis_index(AXIS) * width, width, axis=-1)
        return (part, *out[1:])

    rep = PartitionSpec()
    args = (flat, tokens, cache, block) + (() if select is None else (select,))
    specs = (list(net.tp.specs), rep, cache_spec(cache), rep) + (() if select is None else (rep,))
    out = (vocab_spec(3), cache_spec(cache)) + (() if feats is None else (rep,))
    return _shard_map(net, step, specs, out)(*args)


def _local_rows(w, rows: int):
    """A row-parallel weight as this device's ``rows`` input rows. The layout splits them
    (``sharding.place``) except for a quantized weight with one scale group over K (int8 per
    output channel), which stays whole there; its one scale row covers every row, so this
    device's slice of the codes with the same scales is its part."""
    if not quant.is_quantized(w) or w.shape[0] == rows:
        return w
    if w.scales.shape[0] != 1:
        raise OptionError(
            f"a quantized row-parallel weight of {w.scales.shape[0]} scale groups over K does not "
            f"split over {w.shape[0] // rows} devices; use KernelConfig(tensor_parallel='gspmd')."
        )
    per = w.values.shape[0] * rows // w.shape[0]  # packed 4-bit codes: two rows a byte
    values = lax.dynamic_slice_in_dim(w.values, lax.axis_index(AXIS) * per, per, 0)
    return dataclasses.replace(w, values=values, group=rows)


def _shard_map(net, fn, in_specs, out_specs):
    k = net.kernels
    # the replication check types every value; Pallas kernels (attention, the one-shot
    # all-reduce) have no rule for it, so it runs where only jnp and lax do
    kernel_reduce = k.all_reduce in ("oneshot", "interpret")
    plain = k.attention == "reference" and k.fused_attention == "off" and not kernel_reduce
    return jax.shard_map(
        fn, mesh=mesh(net.tp.degree), in_specs=in_specs, out_specs=out_specs, check_vma=plain
    )


def vocab_spec(ndim: int) -> PartitionSpec:
    return PartitionSpec(*([None] * (ndim - 1)), AXIS)


# ---------------------------------------------------------------- the vocabulary, split


def _bits(x) -> Int[Array, "..."]:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _float(x) -> Float[Array, "..."]:
    return lax.bitcast_convert_type(x, jnp.float32)


def _argmax_local(logits):
    width = logits.shape[-1]
    best = jnp.max(logits, axis=-1)
    index = jnp.argmax(logits, axis=-1).astype(jnp.int32) + lax.axis_index(AXIS) * width
    pairs = jnp.stack([_bits(best), index], -1)  # one message: [*b, 2]
    every = lax.all_gather(pairs, AXIS, to="invarying")  # [N, *b, 2]
    # the first device holding the maximum: the lowest index wins a tie, as in jnp.argmax
    shard = jnp.argmax(_float(every[..., 0]), axis=0)
    return jnp.take_along_axis(every[..., 1], shard[None], 0)[0]


def argmax(net, logits: Float[Array, "*b v"]) -> Int[Array, "*b"]:
    """``jnp.argmax(logits, -1)`` (int32); over the split vocabulary under the explicit step."""
    if not active(net):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _shard_map(net, _argmax_local, vocab_spec(logits.ndim), PartitionSpec())(logits)


def gumbel_argmax(net, key, logits: Float[Array, "*b v"], temperature: float) -> Int[Array, "*b"]:
    """A draw from softmax(logits / temperature), as argmax(logits / T + G) with G standard
    Gumbel noise for the whole vocabulary from ``key`` (Gumbel-max: exact). Under the explicit
    step each device draws and adds the noise of its own slice (the counter-based generator is
    partitionable), and ``argmax`` compares the devices' best."""
    noise = jax.random.gumbel(key, logits.shape, jnp.float32)
    return argmax(net, logits.astype(jnp.float32) / temperature + noise)


def _gather_local(logits):
    return lax.all_gather(logits, AXIS, axis=logits.ndim - 1, tiled=True, to="invarying")


def gather(net, logits: Float[Array, "*b v"]) -> Float[Array, "*b v"]:
    """The whole logits on every device (one all-gather under the explicit step; as they are
    otherwise): for the rules that need whole distributions."""
    if not active(net):
        return logits
    return _shard_map(net, _gather_local, vocab_spec(logits.ndim), PartitionSpec())(logits)


def _top_local(logits, k: int):
    width = logits.shape[-1]
    peak = jnp.max(logits, axis=-1)
    mass = jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1)
    val, idx = lax.top_k(logits, k)
    idx = idx.astype(jnp.int32) + lax.axis_index(AXIS) * width
    packed = jnp.concatenate([_bits(peak)[..., None], _bits(mass)[..., None], _bits(val), idx], -1)
    every = jnp.moveaxis(lax.all_gather(packed, AXIS, to="invarying"), 0, -2)  # [*b, N, 2 + 2k]
    peaks, masses = _float(every[..., 0]), _float(every[..., 1])
    top = jnp.max(peaks, axis=-1)
    lse = top + jnp.log(jnp.sum(masses * jnp.exp(peaks - top[..., None]), axis=-1))
    vals = _float(every[..., 2 : 2 + k]).reshape(*every.shape[:-2], -1)
    ids = every[..., 2 + k :].reshape(*every.shape[:-2], -1)
    best, at = lax.top_k(vals, k)  # device order, then each device's order: lowest index first
    return jnp.take_along_axis(ids, at, -1), best - lse[..., None]


# Rows longer than this go through ``top_k`` in two stages. XLA's GPU top-k kernel gives a row
# one thread block: a tree draft's 9 rows of SmolLM2's 49152 log-probs took it 25.7 us a call, 4
# calls a tree round; in two stages 8.9 us and a sort of 192 entries (one H100: 105 -> 56 us a
# round, benchmarks/results/spec_rounds.json). The second stage counts ranks (``ranking``) where
# its row is short enough, instead of a sort kernel.
TOP_K_CHUNK = 1024


def top_k(x: Float[Array, "*b v"], k: int) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    """``lax.top_k`` over the last axis, the same values and indices (ties: lowest index first),
    as the top ``k`` of each ``TOP_K_CHUNK``-wide chunk, then the top ``k`` of those: many short
    rows instead of a few long ones. The last chunk is padded with -inf, which sorts after every
    real entry of equal value (it sits at higher indices)."""
    v = x.shape[-1]
    if v <= 2 * TOP_K_CHUNK or k > TOP_K_CHUNK:
        val, idx = lax.top_k(x, k)
        return val, idx
    chunks = -(-v // TOP_K_CHUNK)
    pad = chunks * TOP_K_CHUNK - v
    xs = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    val, idx = lax.top_k(xs.reshape(*x.shape[:-1], chunks, TOP_K_CHUNK), k)
    idx = idx + (jnp.arange(chunks, dtype=idx.dtype) * TOP_K_CHUNK)[:, None]
    best_k = ranking.top_k if chunks * k <= ranking.MAX_COUNTED else lax.top_k
    best, at = best_k(val.reshape(*x.shape[:-1], chunks * k), k)
    return best, jnp.take_along_axis(idx.reshape(*x.shape[:-1], chunks * k), at, axis=-1)


def top_log_probs(
    net, logits: Float[Array, "*b v"], k: int
) -> tuple[Int[Array, "*b k"], Float[Array, "*b k"]]:
    """The ``k`` most likely tokens and their log-probabilities, best first; under the explicit
    step from one all-gather of each device's top ``k`` and log-sum-exp terms."""
    if not active(net):
        val, tok = top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
        return tok.astype(jnp.int32), val
    fn = functools.partial(_top_local, k=k)
    rep = PartitionSpec()
    return _shard_map(net, fn, vocab_spec(logits.ndim), (rep, rep))(logits.astype(jnp.float32))
