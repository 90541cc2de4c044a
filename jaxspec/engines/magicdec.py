"""MagicDec (arXiv 2408.11049): batched long-context speculation with a sparse-KV draft.

The draft's KV cache has a fixed budget, so its step costs about the same at any context while
the target's grows with it: past a critical length, speculation pays off even at large batch.
Drafts: ``"self-streaming"`` (the target with a StreamingLLM cache: ``sinks`` first tokens plus a
ring of the recent ``window``), ``"self-snapkv"`` (the target with a SnapKV cache: positions the
last ``obs`` prompt queries attend to most plus the recent ``window``), or a small draft Model
with either cache (``sparse="streaming" | "snapkv"``; ``"dense"`` keeps its full cache).

The decoding loop is the chain engine's (the whole loop on device, ragged per-row acceptance,
EOS per row) or, with ``shape="tree"`` (beyond MagicDec, which is chain-only), the tree engine's:
best-first growth by the same sparse-KV draft, one tree-masked verify of the best ``bs`` nodes
per row, the draft's ring committed along each row's accepted path. This module resolves the
draft and builds that program; ``gamma="auto"`` and ``shape="auto"`` are open choices that
``jaxspec.generate`` hands to MagicDec's cost model (``measure.cost_model.tune``: measured T_T,
T_D, T_V(gamma), alpha, and the tree's T_E, T_V(bs) and length) before building it.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxspec.engines import base, chain, tree
from jaxspec.errors import DraftError, OptionError
from jaxspec.model.feature_head import FeatureModel
from jaxspec.model.transformer import Model
from jaxspec.spec import drafts, tree_drafts

GAMMAS = range(1, 9)  # the cost model's candidates for gamma="auto"
# On a CPU: each candidate costs a compile of its verify (3-16 s for SmolLM2 on 2 loaded cores)
# and T_V grows about linearly with gamma there (40.3, 45.1, 56.1 ms at 1, 2, 4; a 32-token
# context), so three points bracket the choice in a third of the wait.
CPU_GAMMAS = (1, 2, 4)


def candidate_gammas(backend: str | None = None) -> tuple[int, ...]:
    """The gammas ``gamma="auto"`` chooses from on ``backend`` (default: JAX's)."""
    return tuple(GAMMAS) if (backend or jax.default_backend()) == "gpu" else CPU_GAMMAS


SHAPES = ("auto", "chain", "tree")
SPARSE = ("streaming", "snapkv", "dense")


@dataclasses.dataclass(frozen=True)
class Options(base.SparseOptions):
    """``gamma`` (an int, or "auto": the cost model picks from ``candidate_gammas()``);
    ``shape`` ("auto", "chain", "tree"; None: "chain" when gamma is fixed, "tree" when a tree
    option is given, else "auto"); the tree options (None: ``tree.TreeShape``'s defaults);
    ``sparse``: a draft Model's cache ("streaming", the default, "snapkv" or "dense")."""

    gamma: int | str = "auto"
    shape: str | None = None
    depth: int | None = None
    width: int | None = None
    branch: int | None = None
    bs: int | None = None
    sparse: str | None = None

    def __post_init__(self):
        if self.gamma != "auto":
            base.positive_int("gamma", self.gamma, maximum=chain.MAX_GAMMA)
        if self.shape not in (None, *SHAPES):
            raise OptionError(
                f"shape must be one of {', '.join(map(repr, SHAPES))}, got {self.shape!r}."
            )
        if self.sparse not in (None, *SPARSE):
            raise OptionError(
                f"sparse must be one of {', '.join(map(repr, SPARSE))}, got {self.sparse!r}."
            )
        given = self.tree_options_given
        if self.shape == "chain" and given:
            raise OptionError(
                f"{', '.join(given)} shape a tree; pass shape='tree' (or 'auto') to verify trees."
            )
        if self.shape == "tree" and self.gamma != "auto":
            raise OptionError(
                "gamma is the length of a chain; with shape='tree' the tree options "
                "(depth, width, branch, bs) set its size."
            )
        self.tree_shape  # noqa: B018 (validates)

    @property
    def tree_options_given(self) -> list[str]:
        return [k for k in ("depth", "width", "branch", "bs") if getattr(self, k) is not None]

    @property
    def tree_shape(self) -> tree.TreeShape:
        d = tree.TreeShape()
        given = (getattr(self, k) for k in ("depth", "width", "branch", "bs"))
        defaults = (d.depth, d.width, d.branch, d.bs)
        return tree.TreeShape(
            *(v if v is not None else g for v, g in zip(given, defaults, strict=True))
        )

    @property
    def resolved_shape(self) -> str:
        if self.shape is not None:
            return self.shape
        if self.gamma != "auto":
            return "chain"
        return "tree" if self.tree_options_given else "auto"


@dataclasses.dataclass
class MagicDecStats(base.SpecStats):
    shape: str = "chain"
    budget: int | None = None
    alpha: float | None = None  # chain: the alpha whose Omega(gamma, alpha) is the length
    tree: dict | None = None
    predicted_speedup: float | None = None  # the cost model's, when it chose
    cost_model: dict | None = None


def resolve_draft(target: Model, draft, options: Options, kernels):
    """(draft object, its weights) for MagicDec: a sparse-KV self draft, a draft Model with a
    sparse (default "streaming") or "dense" cache, or a feature draft (dense). Checks that the
    draft's recent window holds the largest block a run may speculate."""
    if draft == "ngram":
        raise DraftError(
            "method='magicdec' speculates with a sparse-KV draft: pass draft='self-streaming', "
            "'self-snapkv' or a draft Model; for prompt lookup use method='chain'."
        )
    if draft is None:
        raise DraftError(
            "method='magicdec' needs a sparse-KV draft: pass draft='self-streaming', "
            "'self-snapkv' or a draft Model (which gets a StreamingLLM cache)."
        )
    sparse = options.sparse
    if isinstance(draft, FeatureModel):  # always dense (spec.feature_drafts): resolve checks
        sparse = None if sparse == "dense" else sparse
    elif isinstance(draft, Model):
        sparse = "streaming" if sparse is None else sparse
        sparse = None if sparse == "dense" else sparse
    elif sparse is not None:
        raise OptionError(
            f"sparse={sparse!r} applies to a draft Model; with draft={draft!r} the kind of "
            "cache is in the name ('self-streaming' or 'self-snapkv')."
        )
    d, w = drafts.resolve(
        target, draft, "magicdec", kernels=kernels, sparse=sparse, **options.draft_kwargs()
    )
    shape = options.resolved_shape
    top = max(candidate_gammas()) if options.gamma == "auto" else options.gamma
    depth = options.tree_shape.depth
    need = {"chain": top, "tree": depth, "auto": max(top, depth)}[shape]
    if d.sparse is not None and d.sparse.window < need + 1:
        raise OptionError(
            f"the draft's recent window ({d.sparse.window}) must hold a whole speculated block "
            f"({need + 1} tokens: gamma + 1 for a chain, depth + 1 for a tree); raise the "
            "budget or the window, or lower gamma or depth."
        )
    return d, w


def chain_options(options: Options, gamma: int) -> chain.Options:
    return chain.Options(gamma=gamma, **options.draft_kwargs())


def tree_options(options: Options) -> tree.Options:
    sh = options.tree_shape
    return tree.Options(
        depth=sh.depth, width=sh.width, branch=sh.branch, bs=sh.bs, **options.draft_kwargs()
    )


class MagicDec(base.Engine):
    name = "magicdec"
    Options = Options

    def open_choices(self, options: Options) -> tuple[str, ...]:
        shape = options.resolved_shape
        if shape == "auto":
            return ("shape", "gamma")
        return ("gamma",) if shape == "chain" and options.gamma == "auto" else ()

    def program(self, target, draft, options: Options, req, kernels):
        if self.open_choices(options):
            raise OptionError(
                "magicdec's gamma='auto' / shape='auto' are chosen by measuring "
                "(jaxspec.generate does it through measure.cost_model); pass a gamma, or "
                "shape='tree', to build a program directly."
            )
        d, w = resolve_draft(target, draft, options, kernels)
        if options.resolved_shape == "tree":
            sh = options.tree_shape
            td = tree_drafts.tree_form(d, sh.capacity, sh.depth)
            return tree.ENGINE.program(
                target, None, tree_options(options), req, kernels, resolved=(td, w)
            )
        return chain.ENGINE.program(
            target, None, chain_options(options, options.gamma), req, kernels, resolved=(d, w)
        )

    def engine_of(self, prog) -> base.Engine:
        return tree.ENGINE if isinstance(prog, tree.Program) else chain.ENGINE

    def run(self, prog, target, draft, ids, lens, seed, *, progress=None) -> base.Run:
        r = self.engine_of(prog).run(prog, target, draft, ids, lens, seed, progress=progress)
        return base.Run(r.tokens, r.count, self._stats(prog, r.stats))

    def stream(self, prog, target, draft, ids, lens, seed, *, steps, progress=None):
        r = yield from self.engine_of(prog).stream(
            prog, target, draft, ids, lens, seed, steps=steps, progress=progress
        )
        return base.Run(r.tokens, r.count, self._stats(prog, r.stats))

    def _stats(self, prog, s: base.Stats) -> MagicDecStats:
        """The chain's or tree's stats as MagicDec's (the budget; a chain's alpha)."""
        sp = prog.draft.sparse
        common = dict(
            wall_s=s.wall_s, compile_s=s.compile_s, target_steps=s.target_steps,
            draft_steps=s.draft_steps, acceptance_length=s.acceptance_length,
            budget=None if sp is None else sp.budget,
        )  # fmt: skip
        if isinstance(prog, tree.Program):
            return MagicDecStats(shape="tree", tree=dataclasses.asdict(prog.shape), **common)
        alpha = alpha_from_acceptance_length(s.acceptance_length, prog.gamma)
        return MagicDecStats(shape="chain", gamma=prog.gamma, alpha=alpha, **common)

    def units(self, prog):
        return self.engine_of(prog).units(prog)

    def init(self, prog, *args):
        return self.engine_of(prog).init(prog, *args)

    def step(self, prog, *args):
        return self.engine_of(prog).step(prog, *args)

    def decode(self, prog, *args):
        return self.engine_of(prog).decode(prog, *args)

    def shifted(self, prog, s, k: int):
        return self.engine_of(prog).shifted(prog, s, k)


def omega(gamma: int, alpha: float) -> float:
    """Expected tokens per verification: (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def alpha_from_acceptance_length(length: float, gamma: int) -> float:
    """The alpha whose Omega(gamma, alpha) equals a measured acceptance length (tokens per
    verification), by bisection; clipped to [0, 1]."""
    if length >= gamma + 1:
        return 1.0
    if length <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if omega(gamma, mid) < length else (lo, mid)
    return (lo + hi) / 2


ENGINE = base.register(MagicDec())
