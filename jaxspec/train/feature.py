"""The feature draft's recipe (``jaxspec distill --kind feature``): EAGLE-1's head and losses.

On a window of target-written text ``x_0..x_{T-1}`` the target's forward gives, at every
position, its final state ``f_t`` and logits (the teacher). The head reads the pairs
``(f_t + noise, x_{t+1})`` for ``t < T - 1`` in one causal forward and predicts ``g_{t+1}``:

- **feature regression**: SmoothL1(g_{t+1}, f_{t+1}) (EAGLE-1's, beta 1), weight
  ``feature_weight``;
- **token loss**: KL(target's p(x_{t+2}) || the head's, through the target's LM head on
  ``g_{t+1}``) over the full vocabulary, plus ``ce_weight`` times the CE on the target's greedy
  token, weight ``token_weight``;
- **noise**: EAGLE-1 adds uniform noise of width ``noise`` (its 0.2: U(-0.1, 0.1)) to the input
  states in training, so the head tolerates the error of its own states when it drafts on them.

With ``ttt_steps`` K > 1 the step adds a *training-time test* (HASS, arXiv 2408.15766; EAGLE-3,
arXiv 2503.01840): the head is run again K - 1 times on its own predicted states, as it drafts
after its first step. Step j's input at position t is step j - 1's prediction of ``f_t`` (made at
t - 1) with ``x_{t+1}``; its query sees what a drafting head's cache holds there: the true pairs
up to t - j (step 0's keys) and the predicted pairs of the steps in between (step i's key at
t - j + i), never a predicted pair the drafting head would not have made. Every step has the
same targets (``f_{t+1}`` and ``p(x_{t+2})``) at the positions t >= j where that context exists,
and the loss is their mean. The states fed back are constants for the gradient (the earlier
steps run once more without it), so the cost is one forward of K·(T-1) pairs with its backward
plus K - 1 smaller forwards. ``ttt_steps`` 1 is EAGLE-1's loss as above.

With fused ``reads`` (EAGLE-3's input, ``model.feature_head``) the target's states at every read
layer are the teacher's too: the noise is added to them all, the head's ``fuse`` (trained with
the rest) maps them to its input, and the regression's target stays the final state ``f_{t+1}``,
which the head's ``g`` stands in for when fed back.

The teacher is computed inside the jitted step, like the small draft's; the target's embedding
and LM head are the head's, frozen. The head starts from random weights (EAGLE-1's), or from a
finished head's (``Recipe.init_from``; a shallower one grown by ``init_from.grown``, an EAGLE-1
one given fused reads by ``feature_head.widened``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.io.draft_checkpoint import _assemble
from jaxspec.model.feature_head import (
    SHARED,
    FeatureHead,
    apply_head,
    fuse_states,
    head_config,
    parse_reads,
)
from jaxspec.model.kv_cache import Block, init_cache
from jaxspec.model.transformer import FINAL, Model, Net, full_logits
from jaxspec.train.recipe import Recipe, apply_grads, losses


def reads_of(target: Model, recipe) -> tuple[int, ...]:
    """The target states the recipe's head reads (``Recipe.reads``, parsed)."""
    return parse_reads(recipe.reads, target.config.num_layers)


def init_head(target: Model, recipe: Recipe) -> dict:
    """The head's trainable weights (float32 pure dict, without the shared arrays), random."""
    cfg = head_config(target.config, recipe.layers, recipe.intermediate)
    reads = reads_of(target, recipe)
    module = FeatureHead(cfg, reads=reads, dtype=jnp.float32, rngs=nnx.Rngs(recipe.seed))
    pure = nnx.to_pure_dict(nnx.state(module))
    return {k: v for k, v in pure.items() if k not in SHARED}


def head_shapes(target: Model, recipe: Recipe) -> dict:
    """Zeros of the trainable weights' shapes (the restore template; no compute)."""
    cfg = head_config(target.config, recipe.layers, recipe.intermediate)
    reads = reads_of(target, recipe)
    abstract = nnx.eval_shape(
        lambda: FeatureHead(cfg, reads=reads, dtype=jnp.float32, rngs=nnx.Rngs(0))
    )
    pure = nnx.to_pure_dict(nnx.state(abstract))
    return jax.tree.map(
        lambda x: jnp.zeros(x.shape, jnp.float32),
        {k: v for k, v in pure.items() if k not in SHARED},
    )


def smooth_l1(x, y):
    """SmoothL1 (Huber with beta 1) per element."""
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def feature_losses(teacher_logits, states, head_logits, g, recipe):
    """EAGLE-1's loss per position (module docstring) and its parts: the teacher's
    ``teacher_logits``/``states`` at positions ``1..T-1`` against the head's outputs (the
    teacher's may broadcast against them: one copy for the K steps of a training-time test)."""
    token, kl, ce, agree = losses(teacher_logits, head_logits, recipe.ce_weight)
    feat = jnp.mean(smooth_l1(g, states), axis=-1)
    return recipe.feature_weight * feat + recipe.token_weight * token, kl, ce, agree, feat


def ttt_block(b: int, n: int, steps: int) -> Block:
    """The block of ``steps`` runs of the head over ``n`` pairs each, laid side by side (step j's
    pair t at column ``j * n + t``, RoPE position t, cache slot its column): step 0 is causal;
    step j's pair t sees step 0's pairs up to t - j and step i's pair t - j + i for 0 < i <= j
    (module docstring)."""
    t = np.arange(n)
    mask = np.zeros((steps * n, steps * n), bool)
    for j in range(steps):
        rows = j * n + t
        mask[rows[:, None], t[None, :]] = t[None, :] <= t[:, None] - j
        for i in range(1, j + 1):
            src = t - j + i
            ok = src >= 0
            mask[rows[ok], i * n + src[ok]] = True
    columns = jnp.arange(steps * n, dtype=jnp.int32)
    return Block(
        positions=jnp.broadcast_to(columns % n, (b, steps * n)),
        slots=jnp.broadcast_to(columns, (b, steps * n)),
        block_mask=jnp.broadcast_to(jnp.asarray(mask), (b, steps * n, steps * n)),
    )


def ttt_forward(net: Net, flat, tokens, inputs, steps: int):
    """The head's ``steps`` runs over the pairs ``(inputs [B, n, d], tokens [B, n])`` (module
    docstring): ``(logits [B, steps * n, V], g [B, steps * n, d])``, step j's at columns
    ``j * n ...``. Step j's inputs are step j - 1's predictions, shifted one position (the true
    input where there is none), computed first and held constant for the gradient."""
    b, n = tokens.shape
    feats = inputs
    for j in range(1, steps):
        cache = init_cache(net.cfg, b, j * n, net.dtype)
        last_step = jnp.broadcast_to(jnp.arange((j - 1) * n, j * n, dtype=jnp.int32), (b, n))
        _, g, _ = apply_head(net, flat, jnp.tile(tokens, (1, j)), feats, cache,
                             ttt_block(b, n, j), last_step)  # fmt: skip
        last = jax.lax.stop_gradient(g).astype(inputs.dtype)
        fed = jnp.concatenate([inputs[:, :1], last[:, :-1]], axis=1)
        feats = jnp.concatenate([feats, fed], axis=1)
    cache = init_cache(net.cfg, b, steps * n, net.dtype)
    logits, g, _ = apply_head(net, flat, jnp.tile(tokens, (1, steps)), feats, cache,
                              ttt_block(b, n, steps))  # fmt: skip
    return logits, g


@functools.partial(jax.jit, static_argnames=("tnet", "dnet", "recipe"), donate_argnums=(0, 1))
def feature_step(train, opt_state, shared, tflat, tokens, step, total, *, tnet, dnet, recipe):
    """One optimizer step on ``tokens`` [B, T]: the target's states and logits, the head's
    forward on the noisy pairs (and, with ``ttt_steps`` > 1, on its own states), EAGLE-1's
    loss, AdamW. The metrics are step 0's (the first draft step) and ``agree_last``, the last
    step's top-1 agreement."""
    reads = parse_reads(recipe.reads, tnet.cfg.num_layers)
    logits, read = full_logits(tnet, tflat, tokens, reads)
    logits, read = jax.lax.stop_gradient((logits, read))
    d = tnet.cfg.hidden_size
    at = reads.index(FINAL) * d
    states = read[..., at : at + d]  # the final states: the regression's targets
    dtype = tnet.dtype
    key = jax.random.fold_in(jax.random.key(17), step)  # the same noise on a resumed run
    inputs = read[:, :-1]
    # each read's own noise; the final state's drawn as an EAGLE-1 head's (a widened head's
    # first step is the EAGLE-1 head's to the bit)
    keys = [key if i == FINAL else jax.random.fold_in(key, 1 + j) for j, i in enumerate(reads)]
    shape = (*inputs.shape[:-1], d)
    noise = [recipe.noise * (jax.random.uniform(k, shape, jnp.float32) - 0.5) for k in keys]
    inputs = (inputs.astype(jnp.float32) + jnp.concatenate(noise, axis=-1)).astype(dtype)
    k, n = recipe.ttt_steps, inputs.shape[1]
    # step j's loss counts at positions t >= j, where its context exists (module docstring)
    weight = (jnp.arange(n)[None, :] >= jnp.arange(k)[:, None]).astype(jnp.float32)
    weight = weight / weight.sum(axis=1, keepdims=True) / k

    def loss_fn(w):
        flat = jax.tree.leaves(_assemble(jax.tree.map(lambda x: x.astype(dtype), w), shared))
        fused = fuse_states(dnet, flat, inputs)  # themselves for an EAGLE-1 head
        head_logits, g = ttt_forward(dnet, flat, tokens[:, 1:], fused, k)
        b = tokens.shape[0]
        # the K steps against one copy of the teacher ([B, 1, n, ...], broadcast): a tiled
        # [B, K·n, V] teacher and its log-probabilities made 57 GiB of temporaries at 32 x 512
        loss, kl, ce, agree, feat = feature_losses(
            logits[:, None, 1:], states[:, None, 1:], head_logits.reshape(b, k, n, -1),
            g.reshape(b, k, n, -1), recipe,
        )  # fmt: skip
        metrics = {"kl": kl[:, 0].mean(), "ce": ce[:, 0].mean(), "agree": agree[:, 0].mean(),
                   "feat": feat[:, 0].mean(),
                   "agree_last": (agree[:, -1] * weight[-1]).sum(axis=-1).mean() * k}  # fmt: skip
        return (loss * weight).sum(axis=(1, 2)).mean(), metrics

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
    train, opt_state, lr = apply_grads(train, opt_state, grads, step, total, recipe)
    return train, opt_state, {"loss": loss, "lr": lr, **aux}
