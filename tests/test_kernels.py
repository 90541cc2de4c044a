"""Pallas attention kernels vs the pure-jnp reference on fresh random inputs.

On CPU the kernels run through the Pallas interpreter (its outputs start as NaN, so an output
element the kernel forgets to write shows up); on a GPU backend (``JAX_PLATFORMS=cuda``) the same
tests run the compiled kernel. Unused cache slots are poisoned with NaN: the kernel must never
read them (the reference gets zeros there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (
    BLOCK_TILE,
    MAX_N,
    decode_attention,
    decode_attention_partials,
    plan,
    unsupported_reason,
)
from pallas_kernels.dispatch import attention, choose_impl
from pallas_kernels.reference import attend

INTERPRET = jax.default_backend() != "gpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def tree_masks(rng: np.random.Generator, b: int, t: int, n: int, real: np.ndarray) -> np.ndarray:
    """Random ancestor-closed tree masks ``[b, t, n]``: node i sees itself and its ancestors
    (parents come earlier); queries ``>= real[b]`` are padding and see no block slot."""
    out = np.zeros((b, t, n), bool)
    for r in range(b):
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        for i in range(min(t, n, real[r])):
            j = i
            while j >= 0:
                out[r, i, j] = True
                j = parent[j]
    return out


def make_inputs(seed, *, b, t, kh, g, s, n, lengths, dtype, hd=64):
    """Random q/k/v with NaN in every slot no query may see; returns (kernel args, clean args)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    real = rng.integers(1, t + 1, b)
    real[0] = t
    mask = tree_masks(rng, b, t, n, real)
    q = rng.standard_normal((b, t, kh * g, hd)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, hd)).astype(np.float32)
    v = rng.standard_normal((b, s, kh, hd)).astype(np.float32)
    q, k, v = (np.array(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
    used = np.arange(s)[None, :] < (lengths[:, None] + n)  # prefix + block slots
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[~used], v_bad[~used] = np.nan, np.nan
    k[~used], v[~used] = 0.0, 0.0
    length, bm = jnp.asarray(lengths), jnp.asarray(mask)
    poisoned = tuple(jnp.asarray(x, dtype) for x in (q, k_bad, v_bad)) + (length, bm)
    clean = tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (length, bm)
    return poisoned, clean


def check(got, clean, dtype):
    want = attend(*(x.astype(jnp.float32) if x.dtype == dtype else x for x in clean))
    got = np.asarray(got.astype(jnp.float32))
    assert not np.isnan(got).any(), "NaN leaked into the output"
    np.testing.assert_allclose(got, np.asarray(want), atol=TOL[dtype], rtol=TOL[dtype])


CASES = [
    # (T, G, S, N, lengths, dtype): N = T except where a wider block is tested.
    pytest.param(1, 1, 64, 1, [0, 1, 37, 63], jnp.float32, id="decode-odd-lengths-f32"),
    pytest.param(1, 3, 100, 1, [99, 0, 50], jnp.bfloat16, id="decode-gqa3-bf16"),
    pytest.param(5, 3, 96, 5, [91, 0, 37, 1], jnp.float32, id="t5-gqa3-ragged-f32"),
    pytest.param(5, 2, 80, 5, [75, 12], jnp.float16, id="t5-gqa2-f16"),
    pytest.param(16, 1, 300, 16, [284, 37], jnp.bfloat16, id="tree16-bf16"),
    pytest.param(16, 3, 128, 20, [1, 108], jnp.float32, id="tree16-n20-gqa3-f32"),
    pytest.param(64, 1, 200, 64, [136, 0], jnp.float32, id="tree64-f32"),
]


@pytest.mark.parametrize("t, g, s, n, lengths, dtype", CASES)
def test_matches_reference(t, g, s, n, lengths, dtype):
    poisoned, clean = make_inputs(
        t * 7 + g, b=len(lengths), t=t, kh=2, g=g, s=s, n=n, lengths=lengths, dtype=dtype
    )
    got = decode_attention(*poisoned, interpret=INTERPRET)
    assert got.shape == poisoned[0].shape and got.dtype == dtype
    check(got, clean, dtype)


@pytest.mark.parametrize(
    "t, n, lengths, dtype",
    [(9, 129, [150, 3], jnp.bfloat16), (4, 200, [0, 77], jnp.float32)],
    ids=["draft-tree-129-bf16", "feature-tree-like-200-f32"],
)
def test_blocks_wider_than_a_tile(t, n, lengths, dtype):
    """Blocks of more than ``BLOCK_TILE`` slots (a model draft's tree expansion: 9 queries over
    its 129-node window; a feature draft's default tree has 193) go through the kernel in tiles,
    every tile's slots seen: each query sees a random third of the block, some of it in every
    tile. Past ``MAX_N`` the dispatcher takes the flash kernel."""
    poisoned, clean = make_inputs(
        n, b=len(lengths), t=t, kh=2, g=3, s=max(lengths) + n + 5, n=n, lengths=lengths,
        dtype=dtype,
    )  # fmt: skip
    rng = np.random.default_rng(n)
    mask = rng.random((len(lengths), t, n)) < 0.3
    mask[:, :, ::BLOCK_TILE] = True  # every tile has a visible slot for every query
    assert unsupported_reason(poisoned[0], poisoned[1], poisoned[2], jnp.asarray(mask)) is None
    poisoned, clean = (x[:4] + (jnp.asarray(mask),) for x in (poisoned, clean))
    got = decode_attention(*poisoned, interpret=INTERPRET)
    check(got, clean, dtype)
    cut = attend(*(y.astype(jnp.float32) if y.dtype == dtype else y for y in clean[:4]),
                 jnp.asarray(mask).at[:, :, BLOCK_TILE:].set(False))  # fmt: skip
    assert np.abs(np.asarray(got.astype(jnp.float32)) - np.asarray(cut)).max() > 0.1, (
        "the slots past the first tile changed nothing: the test would not see them dropped"
    )
    wide = jnp.ones((len(lengths), t, MAX_N + 1), bool)
    assert "block size" in unsupported_reason(poisoned[0], poisoned[1], poisoned[2], wide)


@pytest.mark.parametrize("k_splits, block_k", [(1, 16), (3, 16), (5, 32)])
def test_splits_and_blocks(k_splits, block_k):
    """Forced split counts / KV block sizes (split boundaries inside and past the lengths)."""
    poisoned, clean = make_inputs(
        3, b=3, t=4, kh=1, g=4, s=150, n=4, lengths=[146, 70, 5], dtype=jnp.float32
    )
    got = decode_attention(*poisoned, k_splits=k_splits, block_k=block_k, interpret=INTERPRET)
    check(got, clean, jnp.float32)


def test_block_past_capacity():
    """A block that runs past the cache end: slots >= S are invisible (as in ``visible``)."""
    rng = np.random.default_rng(5)
    b, t, s, kh, hd = 2, 6, 64, 1, 64
    q = jnp.asarray(rng.standard_normal((b, t, kh, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kh, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kh, hd)), jnp.float32)
    length = jnp.asarray([s - 2, s], jnp.int32)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
    got = decode_attention(q, k, v, length, mask, interpret=INTERPRET)
    check(got, (q, k, v, length, mask), jnp.float32)


def test_padding_queries_are_zero():
    """Queries that see nothing (length 0, all-false mask row) return exact zeros."""
    poisoned, _ = make_inputs(
        11, b=2, t=5, kh=2, g=3, s=64, n=5, lengths=[0, 0], dtype=jnp.bfloat16
    )
    q, k, v, length, mask = poisoned
    mask = mask.at[1].set(False).at[0, 3:].set(False)
    got = np.asarray(decode_attention(q, k, v, length, mask, interpret=INTERPRET), np.float32)
    assert (got[1] == 0).all() and (got[0, 3:] == 0).all()
    assert np.isfinite(got).all() and (np.abs(got[0, :3]).sum(-1) > 0).all()


def test_partials_fully_written():
    """Every defined partial (all splits, rows < T*G) is written: the interpreter starts the
    outputs as NaN, so a skipped store would stay NaN."""
    t, g, kh = 3, 3, 2
    poisoned, _ = make_inputs(
        2, b=2, t=t, kh=kh, g=g, s=160, n=t, lengths=[0, 150], dtype=jnp.float32
    )
    acc, m, ssum = decode_attention_partials(*poisoned, k_splits=4, block_k=16, interpret=INTERPRET)
    p = plan(2, 160, kh, t * g, k_splits=4, block_k=16)
    assert acc.shape == (2, kh, p["k_splits"], p["m_pad"], 64)
    for x in (acc[..., : t * g, :], m[..., : t * g], ssum[..., : t * g]):
        assert np.isfinite(np.asarray(x)).all()
    assert (np.asarray(ssum[0, :, :-1, : t * g]) == 0).all()  # length 0: only the block split sees


def test_dispatch():
    poisoned, clean = make_inputs(
        4, b=2, t=8, kh=2, g=2, s=80, n=8, lengths=[70, 3], dtype=jnp.float32
    )
    check(attention(*poisoned, impl="pallas_interpret"), clean, jnp.float32)
    check(attention(*poisoned, impl="interpret"), clean, jnp.float32)
    np.testing.assert_array_equal(attention(*clean, impl="reference"), attend(*clean))
    q, k, v, _, bm = clean
    if jax.default_backend() == "gpu":
        assert choose_impl(q, k, v, bm) == "pallas"
    else:
        assert choose_impl(q, k, v, bm) == "reference"
        np.testing.assert_array_equal(attention(*clean), attend(*clean))
        with pytest.raises(ValueError, match="GPU"):
            attention(*clean, impl="pallas")
    with pytest.raises(ValueError):
        choose_impl(q, k, v, bm, "triton")


def test_unsupported_shapes_fall_back():
    q = jnp.zeros((1, 1, 4, 96))  # head_dim 96
    k = jnp.zeros((1, 32, 2, 96))
    bm = jnp.ones((1, 1, 1), bool)
    assert "head_dim" in unsupported_reason(q, k, k, bm)
    assert choose_impl(q, k, k, bm) == "reference"
    # "pallas" / "interpret" mean the kernel where it takes the shapes, the reference elsewhere
    assert choose_impl(q, k, k, bm, "interpret") == "reference"
    assert choose_impl(q, k, k, bm, "pallas") == "reference"
    length = jnp.zeros((1,), jnp.int32)
    np.testing.assert_array_equal(
        attention(q, k, k, length, bm, impl="interpret"), attend(q, k, k, length, bm)
    )
    q = jnp.zeros((1, 65, 4, 64))
    k = jnp.zeros((1, 32, 2, 64))
    assert "T=65" in unsupported_reason(q, k, k, jnp.ones((1, 65, 65), bool))
    q = jnp.zeros((1, 1, 4, 64))
    assert "dtypes" in unsupported_reason(q, k.astype(jnp.bfloat16), k, bm)
    assert unsupported_reason(q, k, k, bm) is None
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(
            jnp.zeros((1, 1, 4, 96)),
            jnp.zeros((1, 32, 2, 96)),
            jnp.zeros((1, 32, 2, 96)),
            jnp.zeros((1,), jnp.int32),
            bm,
            interpret=True,
        )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_random_configs_slow(seed, dtype):
    """Wider random sweep: random T, G, S, N, ragged lengths and split settings."""
    rng = np.random.default_rng(100 + seed)
    t = int(rng.choice([1, 2, 7, 16, 33, 64]))
    g = int(rng.choice([1, 2, 3, 4]))
    n = t + int(rng.integers(0, 3))
    s = int(rng.integers(n + 1, 700))
    b = 3
    lengths = rng.integers(0, s - n + 1, b)
    lengths[0] = s - n
    poisoned, clean = make_inputs(seed, b=b, t=t, kh=2, g=g, s=s, n=n, lengths=lengths, dtype=dtype)
    ks = int(rng.choice([0, 1, 2, 6])) or None
    got = decode_attention(*poisoned, k_splits=ks, interpret=INTERPRET)
    check(got, clean, dtype)


def test_kernel_runs_per_device_under_tensor_parallelism():
    """q and K/V split by heads over 2 devices: the kernel runs on each device's heads (no
    all-gather of the cache in the compiled program) and matches the reference."""
    from jax.sharding import NamedSharding, PartitionSpec

    kernel, clean = make_inputs(
        7, b=2, t=3, kh=2, g=2, s=40, n=4, lengths=[17, 30], dtype=jnp.float32
    )
    mesh = jax.make_mesh(
        (2,), ("tp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    heads = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    rep = NamedSharding(mesh, PartitionSpec())
    q, k, v, length, bm = kernel
    args = (
        jax.device_put(q, heads),
        jax.device_put(k, heads),
        jax.device_put(v, heads),
        jax.device_put(length, rep),
        jax.device_put(bm, rep),
    )
    impl = "pallas_interpret" if INTERPRET else "pallas"
    fn = jax.jit(lambda *a: attention(*a, impl=impl))
    hlo = fn.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    got = fn(*args)
    assert got.sharding.spec[2] == "tp"
    check(got, clean, jnp.float32)


def test_default_tiling_keeps_kv_blocks_of_8192_elements():
    # 64-wide heads (SmolLM2) get 128-slot blocks and 3 stages, 128-wide (Llama-3-8B) 64 and 2
    small, wide = plan(1, 1100, 3, 3, head_dim=64), plan(1, 4100, 8, 4, head_dim=128)
    assert (small["block_k"], small["num_stages"]) == (128, 3)
    assert (wide["block_k"], wide["num_stages"]) == (64, 2)
    assert plan(1, 4100, 8, 64, head_dim=128)["num_stages"] == 3  # a 64-row tile
    for p in (small, wide):  # splits are whole blocks and cover the cache
        assert p["split_len"] % p["block_k"] == 0
    assert small["split_len"] * small["k_splits"] >= 1100
    # explicit arguments (KernelConfig.attention_tile) win over the defaults
    p = plan(1, 1100, 3, 3, head_dim=64, block_k=32, num_stages=1, min_split=64)
    assert (p["block_k"], p["num_stages"]) == (32, 1)
    assert plan(1, 1100, 3, 3, head_dim=64, block_k=16, num_stages=2)["block_k"] == 16
    assert plan(1, 1024, 1, 1, head_dim=64, block_k=64, min_split=64)["k_splits"] == 16
    assert plan(1, 1024, 1, 1, head_dim=64, block_k=64)["k_splits"] == 8  # min_split 128
    assert plan(1, 1024, 1, 1, head_dim=64, block_k=64, min_split=256)["k_splits"] == 4


def test_attention_tile_reaches_the_kernel(monkeypatch):
    """The A/B tiling travels explicitly: JAXSPEC_ATTN_* -> KernelConfig.attention_tile ->
    ``dispatch.attention(tile=...)`` -> the decode kernel's arguments (result unchanged)."""
    from jaxspec.kernels import KernelConfig
    from pallas_kernels import dispatch

    env = {"JAXSPEC_ATTN_BLOCK_K": "32", "JAXSPEC_ATTN_STAGES": "1", "JAXSPEC_ATTN_WARPS": "2"}
    tile = KernelConfig.from_env(env).attention_tile
    assert tile == (32, 1, None, 2)
    seen = []
    real = dispatch.D.decode_attention

    def spy(*args, **kw):
        seen.append({k: kw[k] for k in ("block_k", "num_stages", "min_split", "num_warps")})
        return real(*args, **kw)

    monkeypatch.setattr(dispatch.D, "decode_attention", spy)
    poisoned, clean = make_inputs(
        6, b=2, t=2, kh=2, g=2, s=96, n=2, lengths=[90, 5], dtype=jnp.float32
    )
    check(attention(*poisoned, impl="interpret", tile=tile), clean, jnp.float32)
    check(attention(*poisoned, impl="interpret"), clean, jnp.float32)
    assert seen == [
        dict(block_k=32, num_stages=1, min_split=None, num_warps=2),
        dict(block_k=None, num_stages=None, min_split=None, num_warps=None),
    ]


def test_kernel_inside_shard_map():
    # SwiftSpec's on-device loop traces the model inside a shard_map (each device its own block;
    # the kernel's custom_partitioning rule is not consulted there)
    from jax.sharding import Mesh, PartitionSpec

    poisoned, clean = make_inputs(
        9, b=2, t=3, kh=2, g=2, s=48, n=3, lengths=[40, 7], dtype=jnp.float32
    )
    mesh = Mesh(jax.devices()[:2], ("w",))
    rows = PartitionSpec("w")
    f = jax.shard_map(
        lambda q, k, v, ln, bm: attention(q, k, v, ln, bm, impl="pallas_interpret"),
        mesh=mesh,
        in_specs=rows,
        out_specs=rows,
        check_vma=False,
    )
    check(jax.jit(f)(*poisoned), clean, jnp.float32)
