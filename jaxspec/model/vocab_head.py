"""A draft's LM head over the target's most frequent tokens only (FR-Spec: Zhao et al. 2025,
"FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling", arXiv 2502.14856; EAGLE-3's drafts also predict over a reduced vocabulary).

The shipped SmolLM2 draft spends 28 of its 32 M multiply-adds a token in the 49152 x 576 LM head
it shares with the target, and the feature head 28 of 33 M. Over the ``K`` tokens that occur
most often in text the target wrote (``token_counts.npy`` beside the draft's weights, counted by
``jaxspec distill``), the head costs ``K / V`` of that, and the draft proposes only those
tokens.

Lossless for any ``K``: the draft's logits are ``-inf`` outside the subset, so its distribution
``q`` is zero there and the acceptance rule (``spec.acceptance``) takes it as any other ``q``: a
token is accepted with probability ``min(1, p / q)`` and a rejection resamples from ``max(p - q,
0)``, which holds the tokens the draft cannot propose; greedy, the target's argmax is kept
whatever the draft proposed. What ``K`` changes is the acceptance length (a token outside the
subset is never drafted) and the draft step's cost.

Where a draft step needs only its best tokens (a tree's children, a greedy chain's token) it
reads the ``K`` logits themselves (``transformer.apply(..., subset=True)``, then
``top_log_probs`` / ``argmax`` here), with no scatter into the whole vocabulary; sampling
chains take the whole row (``q`` over the vocabulary).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.model import tensor_parallel
from jaxspec.model.layers import dequantized, project

# load_draft's "default" head by backend (None: the whole vocabulary), the shipped drafts with
# the real SmolLM2, chain gamma 4, 128 new tokens, the 20 held-out HumanEval prompts
# (benchmarks/RESULTS.md, distill). CPU (float32, 2 cores): the feature head 0.95x
# autoregressive with the whole head, 1.78x at 4096 tokens (3.33 / 3.17 tokens a verification),
# the small draft 1.06x and 1.34x; in another run 8192 against 4096: 1.75x against 1.81x
# (feature), 1.32x against 1.36x (small). GPU (bf16, one H100): the feature head 1.50x whole,
# 1.69x at 16384 (3.39 / 3.33); in the next call 1.64x at 4096 against 1.66x at 16384 (3.14 /
# 3.24): a launch-bound step cares less for the head's bytes than for the tokens a cut loses.
DEFAULT_SIZE: dict[str, int | None] = {"cpu": 4096, "gpu": 16384}
MIN_SIZE = 1  # any subset is lossless: a tree's children past it (-inf) are deterministic
# proposals like the others, kept only where the target's own token is that child


class VocabHead(nnx.Module):
    """``ids`` (ascending token ids, int32 ``[K]``) and their rows of the LM head ``[K, D]``."""

    def __init__(self, ids, rows, vocab_size: int):
        self.ids = nnx.Variable(jnp.asarray(ids, jnp.int32))
        self.rows = nnx.Param(rows)
        self.vocab_size = vocab_size

    def __call__(self, x, kernels: KernelConfig, subset: bool = False) -> Float[Array, "b l v"]:
        """Float32 logits over the whole vocabulary from ``x [b, l, d]`` (the state the LM head
        reads): the subset's products, ``-inf`` elsewhere; ``subset``: the products alone,
        ``[b, l, K]``. Ascending ids keep ``argmax``'s tie order (the lowest id) among the
        subset."""
        small = project(x, self.rows[...], kernels, jnp.float32, w_out_in=True)
        return small if subset else whole(small, self.ids[...], self.vocab_size)


def whole(small: Float[Array, "*b k"], ids: Int[Array, " k"], vocab_size: int):
    """Logits over a subset ``ids`` as logits over the whole vocabulary (``-inf`` elsewhere)."""
    full = jnp.full((*small.shape[:-1], vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(small)


def ids_of(net, flat) -> Int[Array, " k"] | None:
    """At trace time, the token ids of the cut head of the model ``net`` describes, or None
    where ``transformer.apply(..., subset=True)`` gives whole-vocabulary logits: a whole head,
    or the explicit tensor-parallel step."""
    if tensor_parallel.active(net):
        return None
    head = net.params(flat).get("vocab_head")
    return None if head is None else head["ids"][...]


def top_log_probs(net, flat, logits, k: int) -> tuple[Int[Array, "*b k"], Float[Array, "*b k"]]:
    """``tensor_parallel.top_log_probs`` (a tree's children: the ``k`` most likely tokens, best
    first, and their log-probabilities) of logits from ``apply(..., subset=True)``: over the
    subset's ``K`` entries alone (its log-softmax is the whole row's, whose other entries are
    ``-inf``; ties keep the lowest id, the ids ascending). A ``k`` past ``K`` takes the whole
    row, whose children past the subset are the lowest ids outside it at ``-inf``."""
    ids = ids_of(net, flat)
    if ids is not None and k > ids.shape[0]:
        logits, ids = whole(logits, ids, net.cfg.vocab_size), None
    tok, lp = tensor_parallel.top_log_probs(net, logits, k)
    return (tok if ids is None else ids[tok]), lp


def argmax(net, flat, logits) -> Int[Array, "*b"]:
    """The greedy token of logits from ``apply(..., subset=True)``: the lowest id of the
    subset's highest logit."""
    ids = ids_of(net, flat)
    if ids is None:
        return tensor_parallel.argmax(net, logits)
    return ids[jnp.argmax(logits, axis=-1)]


def frequent_ids(counts: np.ndarray, size: int, always=()) -> np.ndarray:
    """The ``size`` most counted token ids (ties: the lower id first), with every id of
    ``always`` (end-of-sequence tokens) in place of the least counted ones, ascending."""
    counts = np.asarray(counts)
    v = counts.shape[0]
    if not MIN_SIZE <= size <= v:
        raise OptionError(
            f"a draft vocabulary of {size} tokens: give between {MIN_SIZE} and the vocabulary's "
            f"{v} (or none for the whole vocabulary)."
        )
    always = np.unique(np.asarray([t for t in always if 0 <= int(t) < v], np.int64))
    ranked = np.argsort(-counts, kind="stable")
    rest = ranked[~np.isin(ranked, always)][: size - always.size]
    return np.sort(np.concatenate([rest, always]).astype(np.int32))


def head_rows(pure: dict, ids: np.ndarray, dtype):
    """The LM head's rows for ``ids`` as a dense ``[K, D]`` array of ``dtype``, from a model's
    (or feature head's) pure parameter dict: ``lm_head``'s kernel ``[D, V]`` or the tied embedding
    ``[V, D]`` (a quantized one stored ``[D, V]``)."""
    head = pure.get("lm_head")
    if head is not None:
        return jnp.asarray(dequantized(head["kernel"], dtype)[:, ids].T, dtype)
    table = pure["embed_tokens"]
    if isinstance(table, (jnp.ndarray, np.ndarray)):
        return jnp.asarray(table[ids], dtype)
    return jnp.asarray(dequantized(table, dtype)[:, ids].T, dtype)


def with_vocab(draft, ids: np.ndarray | None):
    """``draft`` (a ``Model`` or ``FeatureModel``) with its LM head over ``ids`` only, sharing
    every other array; ``ids`` None gives ``draft`` with the whole head back."""
    if ids is None and vocab_size_of(draft) is None:
        return draft
    module = nnx.merge(draft.graphdef, draft.params)
    if ids is None:
        module.vocab_head = nnx.data(None)
    else:
        ids = np.unique(np.asarray(ids, np.int64)).astype(np.int32)  # ascending, each once
        cfg = draft.config
        if ids.size < MIN_SIZE or ids[0] < 0 or ids[-1] >= cfg.vocab_size:
            raise OptionError(
                f"a draft vocabulary needs at least {MIN_SIZE} distinct token ids in [0, "
                f"{cfg.vocab_size}); got {ids.size}"
                + (f", from {ids[0]} to {ids[-1]}." if ids.size else ".")
            )
        pure = nnx.to_pure_dict(draft.params)
        rows = head_rows(pure, ids, draft.dtype)
        module.vocab_head = nnx.data(VocabHead(ids, rows, cfg.vocab_size))
    graphdef, params = nnx.split(module)
    name = draft.name.split(" vocab ")[0] + ("" if ids is None else f" vocab {ids.size}")
    return dataclasses.replace(draft, graphdef=graphdef, params=params, name=name)


def vocab_size_of(draft) -> int | None:
    """How many tokens ``draft``'s head predicts over, or None for the whole vocabulary."""
    head = draft.params.get("vocab_head") if hasattr(draft.params, "get") else None
    return None if head is None else int(head["ids"][...].shape[0])
