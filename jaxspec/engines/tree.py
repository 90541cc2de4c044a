"""Serial tree speculation (SpecExec-style; the baseline SwiftSpec overlaps): the draft grows a
tree by best-first expansion, the target verifies its best ``bs`` nodes in one tree-masked
forward, ``accept_tree`` keeps the longest path the target's own draws follow plus one token,
and both caches commit/re-root without recompute. The whole loop runs on device.

Pieces: ``grow`` (the draft), ``snapshot`` (the verify block of the best ``bs`` nodes),
``verify_and_commit`` (the target, the rule, the target's commit; shared with SwiftSpec's target
worker) and the draft's ``commit`` (re-root); ``step`` is the four in a row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxspec.engines import base
from jaxspec.model import tensor_parallel
from jaxspec.model.kv_cache import KVCache, advance, commit
from jaxspec.model.transformer import Net, apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import drafts, tree_drafts
from jaxspec.spec import tree as T
from jaxspec.spec.acceptance import accept_tree, accept_tree_greedy
from jaxspec.spec.feature_drafts import FeatureDraft
from jaxspec.spec.sampling import Sampling, probs


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Best-first growth: ``depth`` expansions of the ``width`` best leaves, ``branch`` children
    each; the target verifies the best ``bs`` nodes (SwiftSpec: bs = w = 8).

    Depth 3 by default: with the shipped 2-layer draft of SmolLM2-135M-Instruct (real weights,
    one H100, B=1, 1K, 128 new tokens; benchmarks/results/spec_rounds.json's real_smollm2 at
    7deed54) a tree of 3 expansions made 2074 tok/s (2.70 tokens a verification) against 1870
    for 4 (2.83) and 2010 for the gamma-4 chain (2.41): a fourth expansion of 8 leaves costs more
    than the 0.12 tokens it adds. Deeper with bs 16 (6x8x4x16): 1997; one leaf an expansion: 6
    deep 1777. As the default, in the next call (c21442e): 2122 against the chain's 2044; at
    05874ae on another H100 2039 against 2003. With the drafts' heads cut to 16384 tokens (one
    H200, 6b5bd44, small_model.json) it still leads the deeper shapes: 2205 tok/s against 2072
    for 4 expansions and 2027 for 6x8x4x16 (the gamma-4 chain 2316). Verifying 7 nodes (8 rows,
    where 9 pad to 16) lost on an H100 at 54bf7da: 2075 against 2283 (the chain 2342)."""

    depth: int = 3
    width: int = 8
    branch: int = 4
    bs: int = 8

    def __post_init__(self):
        base.positive_int("depth", self.depth, maximum=32)
        base.positive_int("width", self.width, maximum=64)
        base.positive_int("branch", self.branch, maximum=16)
        base.positive_int("bs", self.bs, maximum=128)

    @property
    def capacity(self) -> int:
        return 1 + self.depth * self.width * self.branch


# A feature draft's trees, where depth and bs are left open, by backend (``jax.default_backend()``,
# as the drafts' vocabulary cut): deeper than a model draft's (its head drafts a token for one
# decoder layer and the LM head, and keeps accepting deeper). Public generate() wall, B=1, 128 new
# tokens, the shipped stage-4 head, held-out HumanEval (benchmarks/results/feature_draft.json):
# - gpu: depth 4 and bs 8, from every GPU run of the shipped heads: one H100 (baab0d3, the h100
#   section) 3111 tok/s, 1.99x autoregressive, on 11 prompts against 2870 (1.84x) for depth 6 /
#   bs 16, and 2004 (1.24x) on 10 chat prompts against 1848 (1.15x); the fused-reads head
#   (another H100) 1.93x against 1.74x, and 2948 against 2561 tok/s (small_model.json, 54bf7da,
#   depth 6 / bs 15). Deeper trees accept more (5.27 tokens a verification against 4.10) but their
#   17-row verify and two more head steps cost more than that. The one H200 run (the first
#   shipped head, 2026-12-03) was a tie: 1.48x for depth 6 / bs 16, 1.46x for 4 / 8. Depth 5
#   with bs 15 (a 16-row verify, the padding of bs 8's 9 rows) ran 1.89x against 4 / 8's 1.64x
#   on another H100 (15e56cc, 8 prompts, the h100_shapes section), in one fixed order of rows
#   with 4 / 8 second, where the run above had it last: not yet a ranking to move the default.
# - cpu: depth 5 and bs 11, the 2-core CPU in float32 over all 20 prompts (the cpu_shapes
#   sections, 2026-12-07/08): with the CPU's 4096-token draft head 1.61x autoregressive for both
#   depth 5 / bs 11 and 4 / 8, at 4.23 tokens a verification against 3.75 (depth 5 / bs 15: 4.34
#   at 1.53x; 4 / 15: 3.98 at 1.43x); with the whole head 4.63 against 4.08, 1.04x and 1.05x.
#   Here a verify costs its rows, so the wider and deeper tree pays for itself, and no more.
FEATURE_SHAPE = {"gpu": {"depth": 4, "bs": 8}, "cpu": {"depth": 5, "bs": 11}}


def feature_shape(backend: str | None = None) -> dict:
    """A feature draft's open tree options (depth, bs) on ``backend`` (default: JAX's); a backend
    without its own measurement takes the GPU's."""
    return FEATURE_SHAPE.get(backend or jax.default_backend(), FEATURE_SHAPE["gpu"])


@dataclasses.dataclass(frozen=True)
class Options(base.DraftOptions):
    depth: int | None = None  # None: TreeShape's 3, a feature draft's feature_shape()
    width: int = 8
    branch: int = 4
    bs: int | None = None  # None: 8, a feature draft's feature_shape()

    def __post_init__(self):
        self.shape_for(feature=False)  # validates
        self.shape_for(feature=True)

    def shape_for(self, feature: bool, backend: str | None = None) -> TreeShape:
        """The tree's shape for a feature draft (``feature``) or another kind, on ``backend``
        (default: JAX's)."""
        d = TreeShape(**feature_shape(backend)) if feature else TreeShape()
        depth = d.depth if self.depth is None else self.depth
        return TreeShape(depth, self.width, self.branch, d.bs if self.bs is None else self.bs)

    @property
    def shape(self) -> TreeShape:
        """The shape for a draft that is not a feature head."""
        return self.shape_for(feature=False)


@dataclasses.dataclass(frozen=True)
class Program:
    net: Net
    draft: object  # a resolved tree draft (spec.tree_drafts)
    shape: TreeShape
    req: base.Request
    capacity: int
    chunk: int


@pytree_dataclass
class State:
    cache: KVCache  # target; length == slot of the root (last emitted token)
    out: base.Out
    draft: object
    key: jax.Array


def init(prog: Program, tflat, dflat, ids, lens, seed) -> State:
    cache, tok, out, key, *feats = base.start(
        prog.net, tflat, ids, lens, jax.random.key(seed), prog.req, prog.capacity,
        prog.draft.reads,
    )  # fmt: skip
    pre = tree_drafts.Prefill(ids, lens, cache, prog.capacity, prog.draft.capacity, *feats)
    return State(cache, out, prog.draft.init(dflat, pre, tok), key)


def grow(prog: Program, dflat, dstate):
    """The draft's tree grown by ``depth`` expansions."""
    sh = prog.shape
    return prog.draft.grow(dflat, dstate, expansions=sh.depth, width=sh.width, branch=sh.branch)


def snapshot(tree: T.Tree, bs: int, root_slot, root_pos) -> T.TreeBlock:
    """The best ``bs`` nodes of ``tree`` and its root, laid out as a verify block."""
    idx, cnt = T.select_subtree(tree, bs)
    return T.verify_layout(tree, idx, cnt, root_slot, root_pos)


@pytree_dataclass
class Verified:
    """A verify's outcome: accepted block slots, their number, the next token, and the target's
    output and cache with the root and the accepted path committed; the target's states at the
    block for a draft that reads them (else None)."""

    path: Int[Array, "b m"]
    n: Int[Array, " b"]
    next: Int[Array, " b"]
    cache: KVCache
    out: base.Out
    live: Bool[Array, " b"]  # rows that were live before this verify
    feats: Float[Array, "b t f"] | None = None


def verify_and_commit(
    net: Net, tflat, cache: KVCache, tb: T.TreeBlock, key, out: base.Out, sampling: Sampling, eos,
    features=None,
) -> Verified:  # fmt: skip
    """One target forward over the verify block ``tb``, the lossless tree rule (greedy: argmax
    walk; sampling: ``accept_tree``), the emitted tokens appended to live rows (EOS and length
    limits respected), and the root plus the accepted path committed to the target cache.
    ``features``: the states to return (``transformer.apply``'s), for a draft that reads them."""
    logits, cache, *feats = apply(net, tflat, tb.tokens, cache, tb.block, None, features)
    if sampling.greedy:
        target_tokens = tensor_parallel.argmax(net, logits)
        path, n, nxt = accept_tree_greedy(tb.tokens, tb.parent, tb.valid, target_tokens)
    else:  # the rule draws from whole rows
        p = probs(tensor_parallel.gather(net, logits), sampling)
        path, n, nxt = accept_tree(key, tb.tokens, tb.parent, tb.valid, p)
    new = jnp.concatenate(
        [jnp.take_along_axis(tb.tokens, jnp.maximum(path, 0), 1), jnp.zeros_like(nxt)[:, None]], 1
    )
    new = jnp.where(jnp.arange(new.shape[1])[None, :] == n[:, None], nxt[:, None], new)
    live = ~out.done
    out = base.emit(out, new, n + 1, eos)
    src, cnt = T.verify_commit_src(cache.length, path, n)
    cache = commit(cache, src, jnp.where(live, cnt, 0), mode=net.kernels.fused_commit)
    return Verified(path, n, nxt, cache, out, live, *feats)


def step(prog: Program, tflat, dflat, s: State) -> State:
    key, k_verify = jax.random.split(s.key)
    dstate = grow(prog, dflat, s.draft)
    tb = snapshot(dstate.tree, prog.shape.bs, s.cache.length, s.cache.length)
    v = verify_and_commit(
        prog.net, tflat, s.cache, tb, k_verify, s.out, prog.req.sampling, prog.req.eos,
        prog.draft.reads,
    )  # fmt: skip
    dstate = prog.draft.commit(dstate, tb, v.path, v.n, v.next, v.feats)
    return State(v.cache, v.out, dstate, key)


def decode(prog: Program, tflat, dflat, ids, lens, seed) -> base.Out:
    s = init(prog, tflat, dflat, ids, lens, seed)
    return base.until_done(lambda s: step(prog, tflat, dflat, s), s, prog.chunk).out


# ---- measured units: each keeps its context fixed and its result alive in the state


def _grow_unit(prog, tflat, dflat, s: State, aux) -> State:
    dstate = grow(prog, dflat, s.draft)
    return dataclasses.replace(s, draft=prog.draft.keep_alive(dstate, dstate.tree.token.sum(1)))


def _grown_block(prog, tflat, dflat, s: State) -> T.TreeBlock:
    return snapshot(grow(prog, dflat, s.draft).tree, prog.shape.bs, s.cache.length, s.cache.length)


def _verify_unit(prog, tflat, dflat, s: State, aux) -> State:
    v = verify_and_commit(prog.net, tflat, s.cache, aux, s.key, s.out, prog.req.sampling, ())
    v.cache.length = s.cache.length
    out = dataclasses.replace(s.out, tokens=v.out.tokens)  # the counters stay: a fixed context
    return dataclasses.replace(s, cache=v.cache, out=out)


def tree_stats(prog: Program, out: base.Out, wall_s: float, compile_s: float) -> base.TreeStats:
    sh = prog.shape
    return base.loop_stats(
        base.TreeStats, out, wall_s=wall_s, compile_s=compile_s, draft_per_step=sh.depth,
        depth=sh.depth, width=sh.width, branch=sh.branch, bs=sh.bs,
    )  # fmt: skip


class Tree(base.Engine):
    name = "tree"
    Options = Options
    init = staticmethod(init)
    step = staticmethod(step)
    decode = staticmethod(decode)

    def program(self, target, draft, options: Options, req, kernels, *, resolved=None):
        """``resolved``: an already resolved (tree draft, weights), as MagicDec passes."""
        if resolved is not None:
            (d, w), shape = resolved, options.shape
        else:
            chain, w = drafts.resolve(
                target, draft, "tree", kernels=kernels, **options.draft_kwargs()
            )
            shape = options.shape_for(feature=isinstance(chain, FeatureDraft))
            d = tree_drafts.tree_form(chain, shape.capacity, shape.depth)
        net = target.net(kernels)
        capacity = req.width + req.max_new + shape.capacity + 2
        chunk = base.spec_chunk(net.kernels, req.batch)
        return Program(net, d, shape, req, capacity, chunk), w

    def stats(self, prog, out, wall_s, compile_s) -> base.TreeStats:
        return tree_stats(prog, out, wall_s, compile_s)

    def units(self, prog):
        sh, kind = prog.shape, type(prog.draft).__name__
        return {
            "draft": base.Unit(_grow_unit, f"one grow of depth={sh.depth} expansions ({kind})"),
            "verify": base.Unit(
                _verify_unit, f"one target verify of bs + 1 = {sh.bs + 1} tree nodes",
                prepare=_grown_block,
            ),
        }  # fmt: skip

    def shifted(self, prog, s: State, k: int) -> State:
        cache = advance(s.cache, jnp.full_like(s.cache.length, k))
        return dataclasses.replace(s, cache=cache, draft=prog.draft.shifted(s.draft, k))


ENGINE = base.register(Tree())
