"""SwiftSpec: exact greedy tokens on every device layout, re-root invariants after every
verification, draft growth during verification, faults surfaced as errors, no leaks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import KernelConfig
from jaxspec.api import generate, prepare
from jaxspec.engines import programs
from jaxspec.engines.swiftspec import engine as swiftspec
from jaxspec.engines.swiftspec import workers
from jaxspec.errors import DeviceError, OptionError, WorkerError
from jaxspec.model.kv_cache import causal_block, init_cache
from jaxspec.model.transformer import apply
from tests import tiny

NEW = 20
SHAPE = dict(depth=2, width=3, branch=2, bs=6)
CHANGES = dict(num_heads=4, num_kv_heads=4, vocab_size=64)


def target_and_prompts(seed, lengths=(23, 3, 11)):
    return tiny.model(seed, **CHANGES), tiny.prompts(seed, lengths=lengths, vocab=64)


# one device each and the widest meshes by default; (2, 1) and (2, 2) are the same programs
# sharded in between (25-31 s of compiles each): slow
@pytest.mark.parametrize(
    "layout",
    [
        (1, 1),
        pytest.param((2, 1), marks=pytest.mark.slow),
        pytest.param((2, 2), marks=pytest.mark.slow),
        (4, 2),
    ],
)
def test_swiftspec_greedy_equals_autoregressive_on_every_layout(layout):
    for seed in range(5):
        target, ps = target_and_prompts(seed)
        ref = generate(target, ps, max_new_tokens=NEW).tokens
        for draft in (tiny.model(700 + seed, **CHANGES), tiny.perturbed(target, 0.3, seed)):
            r = generate(
                target,
                ps,
                draft=draft,
                method="swiftspec",
                max_new_tokens=NEW,
                target_devices=layout[0],
                draft_devices=layout[1],
                **SHAPE,
            )
            assert r.tokens == ref, (layout, seed)
            assert (r.stats["target_devices"], r.stats["draft_devices"]) == layout
            assert r.stats["tokens_recomputed"] == 0


@pytest.mark.parametrize("refill", [0, 2])
def test_swiftspec_target_as_draft_grows_during_verification_and_carries_nodes(refill):
    target, ps = target_and_prompts(0)
    r = generate(
        target,
        ps,
        draft=target,
        method="swiftspec",
        max_new_tokens=NEW,
        target_devices=2,
        draft_devices=2,
        depth=2,
        width=1,
        branch=1,
        bs=2,
        refill=refill,
    )
    assert r.tokens == generate(target, ps, max_new_tokens=NEW).tokens
    s = r.stats
    # counted, not timed: expansions dispatched before the verdict was ready
    assert s["expansions_in_flight"] > 0
    assert s["draft_expansions"] >= s["verify_steps"] * 2
    # a chain-shaped tree deeper than bs: the bonus token is in the tree, its subtree survives
    assert s["nodes_carried"] > 0 and s["tokens_recomputed"] == 0
    if refill:
        # the tree is topped up to bs + 1 nodes before each snapshot: every verify accepts
        # bs = 2 tokens plus the bonus
        assert s["acceptance_length"] == pytest.approx(3.0)
        assert s["refill_expansions"] > 0
    else:
        # nothing waits for the draft: it adds at most d = 2 levels per verification, so a
        # chain accepts at most about d tokens a verify (the bonus included), never the full 3;
        # more than 1 because the nodes grown during each verify survive the re-root
        assert 1.0 < s["acceptance_length"] <= 2.2
        assert s["refill_expansions"] == 0


SPARSE = dict(budget=24, sinks=4)  # a ring of 20: the prompts (23, 5, 14) + 32 new wrap it
ACCEPT_NEW = 32


def test_self_streaming_accepts_as_much_as_the_same_weights_as_a_draft_model():
    """A sparse self-draft's tree cache re-roots like a dense one: the tree grown during a
    verify survives, so SwiftSpec accepts about as many tokens a verify with
    draft="self-streaming" as with the target's weights passed as a (dense) draft Model. (When
    the sparse commit started a fresh tree at every re-root it accepted ~1.07 against ~2.0.)"""
    kw = dict(
        method="swiftspec", max_new_tokens=ACCEPT_NEW, target_devices=1, draft_devices=1,
        loop="threads", **SHAPE,
    )  # fmt: skip
    for seed in range(2):
        target, ps = target_and_prompts(seed, lengths=(23, 5, 14))
        sparse = generate(target, ps, draft="self-streaming", **SPARSE, **kw)
        dense = generate(target, ps, draft=target, **kw)
        assert sparse.tokens == dense.tokens, seed
        got, want = sparse.stats["acceptance_length"], dense.stats["acceptance_length"]
        assert want > 1.5, seed  # the dense draft is the target: most of each path is accepted
        assert got == pytest.approx(want, rel=0.1), seed
        assert sparse.stats["nodes_carried"] > 0, seed


@pytest.mark.parametrize("kind", ["model", "self-streaming"])
def test_refill_to_depth_accepts_as_much_as_the_serial_tree_engine(kind):
    """With refill=depth the loop waits for the tree to be regrown before a snapshot, as the
    serial engine grows d levels before each verify: SwiftSpec then accepts as many tokens a
    verify as the ``tree`` engine with the same draft, prompts and tree shape (depth = d), for a
    draft Model and for a sparse self-draft."""
    d = SHAPE["depth"]
    for seed in range(2):
        target, ps = target_and_prompts(seed, lengths=(23, 5, 14))
        draft, opts = (
            (tiny.perturbed(target, 0.05, seed), {}) if kind == "model" else (kind, SPARSE)
        )
        run = dict(draft=draft, max_new_tokens=ACCEPT_NEW, **SHAPE, **opts)
        sw = generate(
            target, ps, method="swiftspec", target_devices=1, draft_devices=1, loop="threads",
            refill=d, **run,
        )  # fmt: skip
        serial = generate(target, ps, method="tree", **run)
        assert sw.tokens == serial.tokens, seed
        assert sw.stats["refill_expansions"] > 0, seed
        got, want = sw.stats["acceptance_length"], serial.stats["acceptance_length"]
        assert want > 1.5, seed
        assert got == pytest.approx(want, rel=0.1), seed


def test_reroot_invariants_hold_after_every_verification():
    target, ps = target_and_prompts(1)
    draft = tiny.perturbed(target, 0.2, 3)
    lens = [len(p) for p in ps]
    checked = []

    def observe(ts, ds):
        out, count = np.asarray(ts.out.tokens), np.asarray(ts.out.count)
        length = np.asarray(ds.cache.length)
        # the draft's root slot is the target's cache length (both dense), and its root token
        # is the last token the target emitted
        live = np.flatnonzero(~np.asarray(ts.out.done))  # finished rows stop committing
        # the last accepted node's K/V when it was a leaf never expanded: computed once by the
        # next expansion's catch-up query (its slot is named until then), never recomputed
        pending = np.asarray(ds.catchup_slot)
        np.testing.assert_array_equal(length[live], np.asarray(ts.cache.length)[live])
        roots = np.asarray(ds.tree.token[:, 0])
        for b in live:
            assert roots[b] == out[b, count[b] - 1]
        # the re-rooted prefix KV equals KV recomputed from scratch for the committed tokens
        for b in live:
            seq = list(ps[b]) + out[b, : count[b] - 1].tolist()
            assert len(seq) == length[b]
            ref_k, ref_v = prefill_kv(draft, seq)
            done = np.arange(length[b]) != pending[b]
            assert done.sum() >= length[b] - 1  # at most one (the last) pending
            for layer in range(draft.config.num_layers):
                np.testing.assert_allclose(
                    ds.cache.k[layer][b, : length[b]][done], ref_k[layer][done], atol=1e-5
                )
                np.testing.assert_allclose(
                    ds.cache.v[layer][b, : length[b]][done], ref_v[layer][done], atol=1e-5
                )
        # kept trees are well formed: parents come before children, depths follow parents
        tree = ds.tree
        valid, parent, depth = (np.asarray(x) for x in (tree.valid, tree.parent, tree.depth))
        for b in range(len(ps)):
            for i in np.flatnonzero(valid[b])[1:]:
                assert 0 <= parent[b, i] < i and depth[b, i] == depth[b, parent[b, i]] + 1
        checked.append(len(live))

    r = generate(
        target,
        ps,
        draft=draft,
        method="swiftspec",
        max_new_tokens=NEW,
        target_devices=1,
        draft_devices=1,
        observe=observe,
        **SHAPE,
    )
    assert r.tokens == generate(target, ps, max_new_tokens=NEW).tokens
    # every verification was checked; the draft thread may also re-root on the last verdict
    # (the one that only re-ran finished rows) before it learns that the run is over
    steps = r.stats["verify_steps"]
    assert steps <= len(checked) <= steps + 1 and sum(checked) > 0 and lens


@functools.partial(jax.jit, static_argnums=0)
def _prefill(net, flat, ids, n):
    cache = init_cache(net.cfg, 1, ids.shape[1])
    zero = jnp.zeros((1,), jnp.int32)
    block = causal_block(zero, zero, n[None], ids.shape[1])
    return apply(net, flat, ids, cache, block)[1]


def prefill_kv(model, seq, width=128):
    """K/V of ``seq`` computed from scratch (padded to one width: one compile)."""
    ids = jnp.array([list(seq) + [0] * (width - len(seq))])
    cache = _prefill(model.net(), model.flat, ids, jnp.array(len(seq), jnp.int32))
    n = len(seq)
    return [np.asarray(x[0, :n]) for x in cache.k], [np.asarray(x[0, :n]) for x in cache.v]


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_a_fault_in_either_worker_raises_and_the_engine_runs_again(worker, monkeypatch):
    target, ps = target_and_prompts(2)
    draft = tiny.perturbed(target, 0.3, 2)
    kwargs = dict(
        draft=draft,
        method="swiftspec",
        max_new_tokens=NEW,
        target_devices=1,
        draft_devices=1,
        **SHAPE,
    )
    if worker == "draft":

        def bad_grow(*args, **kwargs):
            raise RuntimeError("injected fault in the draft")

        monkeypatch.setattr(workers, "draft_grow", bad_grow)
    else:
        real = workers.target_verify

        def bad_verify(*args, **kw):
            s, v, flat = real(*args, **kw)
            return s, workers.Verdict(v.path, v.n - 100, v.next, v.done), flat  # a bad value

        monkeypatch.setattr(workers, "target_verify", bad_verify)
    with pytest.raises(WorkerError, match=worker):
        generate(target, ps, **kwargs)
    monkeypatch.undo()
    assert generate(target, ps, **kwargs).tokens == generate(target, ps, max_new_tokens=NEW).tokens


def test_soak_back_to_back_generations_do_not_grow_live_buffers():
    target, ps = target_and_prompts(3, lengths=(7, 4))
    draft = tiny.perturbed(target, 0.3, 4)
    kwargs = dict(
        draft=draft,
        method="swiftspec",
        max_new_tokens=8,
        target_devices=1,
        draft_devices=1,
        **SHAPE,
    )
    for _ in range(3):
        generate(target, ps, **kwargs)
    before = len(jax.live_arrays())
    for _ in range(12):  # a buffer kept per generation shows after the first
        generate(target, ps, **kwargs)
    assert len(jax.live_arrays()) <= before


def test_swiftspec_says_what_to_do_with_bad_layouts(monkeypatch):
    target, ps = target_and_prompts(4)
    with pytest.raises(DeviceError, match="does not divide"):
        generate(target, ps, draft=target, method="swiftspec", target_devices=3, draft_devices=1)
    with pytest.raises(DeviceError, match="exceeds"):
        generate(target, ps, draft=target, method="swiftspec", target_devices=4, draft_devices=8)
    monkeypatch.setattr(jax, "devices", lambda *a: [jax.local_devices()[0]])
    with pytest.raises(DeviceError, match="method='tree'"):
        generate(target, ps, draft=target, method="swiftspec")


def test_device_loop_gives_the_threaded_loops_tokens_and_acceptance():
    """loop="device" (the iteration as one program over both devices, handoffs by ppermute):
    tokens equal autoregressive decoding's, and each verification accepts what the threaded
    loop's does (same snapshots: d expansions per verification in both)."""
    for seed in range(3):
        target, ps = target_and_prompts(seed)
        ref = generate(target, ps, max_new_tokens=NEW).tokens
        for draft in (tiny.model(700 + seed, **CHANGES), tiny.perturbed(target, 0.3, seed)):
            rs = {
                loop: generate(
                    target,
                    ps,
                    draft=draft,
                    method="swiftspec",
                    max_new_tokens=NEW,
                    target_devices=1,
                    draft_devices=1,
                    loop=loop,
                    **SHAPE,
                )  # fmt: skip
                for loop in ("threads", "device")
            }
            dev, thr = rs["device"], rs["threads"]
            assert dev.tokens == ref, seed
            assert dev.stats["loop"] == "device" and dev.stats["tokens_recomputed"] == 0
            for key in ("verify_steps", "acceptance_length"):
                assert dev.stats[key] == thr.stats[key], (seed, key)
            # d expansions beside every verification, counted from the loop's trip count
            d, steps = SHAPE["depth"], dev.stats["verify_steps"]
            assert dev.stats["expansions_in_flight"] == d * steps
            assert dev.stats["draft_expansions"] == d * (steps + 1)  # + the first snapshot's


def test_device_loop_keeps_its_weights_copy_and_executable_for_the_next_call():
    """The device loop's replicated weights are kept with the placed target model (no module
    global): a second call with the same draft copies no weights and compiles nothing, and the
    copy goes when the model does."""
    import gc
    import weakref

    from jaxspec.engines.swiftspec import device as swiftspec_device

    target, ps = target_and_prompts(7)
    draft = tiny.model(707, **CHANGES)
    kw = dict(draft=draft, method="swiftspec", max_new_tokens=8, target_devices=1)
    ref = generate(target, ps, max_new_tokens=8).tokens

    def replicated_copies(model):
        placed = [v[0] for k, v in model._cache.items() if k[0] == "placed"]
        return [v[1] for m in placed for k, v in m._cache.items() if k[0] == "swiftspec-replicated"]

    runs, kept, loops = [], [], []
    for _ in range(2):
        runs.append(generate(target, ps, draft_devices=1, loop="device", **kw, **SHAPE).tokens)
        (copy,) = replicated_copies(target)
        kept.append(copy)
        loops.append({k for k in programs._COMPILED if k[0] is swiftspec_device.device_loop})
    assert runs[0] == runs[1] == ref
    assert kept[0] is kept[1]  # the second call copied no weights
    assert loops[1] == loops[0] and loops[0]  # and compiled nothing
    gone = weakref.ref(jax.tree.leaves(kept[0])[0])
    del target, kept, copy, runs
    gc.collect()
    assert gone() is None


# slow (47 s interpreted): bench_swiftspec_2gpu.py runs this loop with the kernel compiled on
# two GPUs and compares its tokens with the serial engine's; the kernel's own tests (interpreted
# here) cover its numerics
@pytest.mark.slow
def test_device_loop_with_the_pallas_attention_kernel():
    """The kernel (interpreted here; compiled on a GPU) inside the loop's shard_map, cond and
    while_loop, through its custom_partitioning wrapper: tokens still equal autoregressive."""
    changes = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=64, vocab_size=64)
    target = tiny.model(1, **changes)
    ps = tiny.prompts(1, lengths=(23, 3, 11), vocab=64)
    ref = generate(target, ps, max_new_tokens=10).tokens
    r = generate(
        target, ps, draft=tiny.perturbed(target, 0.3, 1), method="swiftspec", max_new_tokens=10,
        target_devices=1, draft_devices=1, loop="device",
        kernels=KernelConfig(attention="interpret"), **SHAPE,
    )  # fmt: skip
    assert r.tokens == ref and r.stats["acceptance_length"] > 1.0


def test_auto_loop_runs_on_the_device_for_a_large_target_only(monkeypatch):
    """loop="auto" (the default): the device loop for a 1 + 1 layout whose target weighs at
    least AUTO_DEVICE_BYTES, unless an option only the threaded loop takes is given; the
    threaded loop otherwise (tiny models here: the threshold is moved to test both sides). The
    choice is the program's (``prepare`` builds it, compiling nothing; a run runs its loop and
    reports it); the device loop it chose runs once, at the shapes of the device loop's test
    above (its programs are found when that test ran first). The threaded loops' tokens are
    the layout and refill tests'."""
    target, ps = target_and_prompts(8)
    draft = tiny.model(708, **CHANGES)
    kw = dict(draft=draft, method="swiftspec", max_new_tokens=NEW, **SHAPE)

    def loop_of(**more):
        return prepare(target, ps, **kw, **more).prog.loop

    assert loop_of(target_devices=1, draft_devices=1) == "threads"  # a tiny target
    monkeypatch.setattr(swiftspec, "AUTO_DEVICE_BYTES", 0)
    target._cache.pop("programs", None)  # prepare keeps programs per call; the rule changed
    assert loop_of(target_devices=1, draft_devices=1) == "device"
    assert loop_of(target_devices=1, draft_devices=1, refill=1) == "threads"
    assert loop_of(target_devices=2, draft_devices=1) == "threads"
    assert loop_of(target_devices=1, draft_devices=1, loop="threads") == "threads"
    r = generate(target, ps, target_devices=1, draft_devices=1, **kw)
    assert r.stats["loop"] == "device"
    assert r.tokens == generate(target, ps, max_new_tokens=NEW).tokens


def test_device_loop_says_what_it_does_not_take():
    target, ps = target_and_prompts(5)
    draft = tiny.model(705, **CHANGES)
    base = dict(draft=draft, method="swiftspec", max_new_tokens=4, **SHAPE)
    with pytest.raises(OptionError, match="one device per worker"):
        generate(target, ps, target_devices=2, draft_devices=1, loop="device", **base)
    with pytest.raises(OptionError, match="max_extra"):
        generate(target, ps, target_devices=1, draft_devices=1, loop="device", max_extra=2, **base)
    with pytest.raises(OptionError, match="loop must be one of"):
        generate(target, ps, target_devices=1, draft_devices=1, loop="gpu", **base)


def test_device_loop_stops_when_a_verdict_never_says_done(monkeypatch):
    """A target that never reports done (a bug) ends in a WorkerError after max_new
    verifications, not in a loop that spins forever."""
    real = workers.target_verify

    def stuck(*args, **kwargs):
        s, v, _ = real(*args, **kwargs)
        s = dataclasses.replace(s, out=dataclasses.replace(s.out, done=jnp.zeros_like(s.out.done)))
        v = dataclasses.replace(v, done=jnp.zeros_like(v.done))
        return s, v, workers.pack(v)

    def forget():  # programs compiled with the real verify (or, after, with the stuck one)
        programs._COMPILED.clear()
        jax.clear_caches()

    monkeypatch.setattr(workers, "target_verify", stuck)
    forget()
    target, ps = target_and_prompts(6)
    try:
        with pytest.raises(WorkerError, match="never said done"):
            generate(
                target, ps, draft=tiny.model(706, **CHANGES), method="swiftspec",
                max_new_tokens=6, target_devices=1, draft_devices=1, loop="device", **SHAPE,
            )  # fmt: skip
    finally:
        forget()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    import jaxspec
    from jaxspec.io.default_model import default_checkpoint

    return jaxspec.load(default_checkpoint(tmp_path_factory.mktemp("ck"), progress=False))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, loop", [((1, 1), "threads"), ((3, 1), "threads"), ((1, 1), "device")]
)  # SmolLM2: 9 heads, 3 kv heads
def test_swiftspec_greedy_equals_autoregressive_on_real_smollm2(smollm2, layout, loop):
    from benchmarks.common import humaneval_prompts

    prompts = [smollm2.tokenizer.encode(p)[-40:] for p in humaneval_prompts(2)]
    ref = generate(smollm2, prompts, max_new_tokens=24).tokens
    r = generate(
        smollm2,
        prompts,
        draft="self-streaming",
        method="swiftspec",
        max_new_tokens=24,
        target_devices=layout[0],
        draft_devices=layout[1],
        depth=2,
        width=4,
        branch=2,
        bs=6,
        budget=32,
        sinks=4,
        loop=loop,
    )
    assert r.tokens == ref
    assert r.stats["acceptance_length"] > 1.0


def test_pack_carries_float_scores_exactly():
    """The device loop sends the grown tree across with its float32 scores as bits: the
    snapshot both devices compute from it must see the same scores, ties and -inf included."""
    scores = jnp.asarray([[0.0, -jnp.inf, 1e-38, -3.2e-5, 7.25]], jnp.float32)
    tree = dict(score=scores, ok=jnp.asarray([[True, False]]), n=jnp.asarray([3], jnp.int32))
    back = workers.unpack(workers.pack(tree), workers.spec(tree))
    assert back["score"].dtype == jnp.float32 and back["ok"].dtype == jnp.bool_
    for k in tree:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
    with pytest.raises(ValueError, match="32-bit floats"):
        workers.pack({"half": jnp.zeros(2, jnp.bfloat16)})
