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

The teacher is computed inside the jitted step, like the small draft's; the target's embedding
and LM head are the head's, frozen. The head starts from random weights (EAGLE-1's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.io.draft_checkpoint import _assemble
from jaxspec.model.feature_head import SHARED, FeatureHead, head_config, head_forward
from jaxspec.model.transformer import FINAL, Model, full_logits
from jaxspec.train.recipe import Recipe, apply_grads, losses


def init_head(target: Model, recipe: Recipe) -> dict:
    """The head's trainable weights (float32 pure dict, without the shared arrays), random."""
    cfg = head_config(target.config, recipe.layers, recipe.intermediate)
    module = FeatureHead(cfg, dtype=jnp.float32, rngs=nnx.Rngs(recipe.seed))
    pure = nnx.to_pure_dict(nnx.state(module))
    return {k: v for k, v in pure.items() if k not in SHARED}


def head_shapes(target: Model, recipe: Recipe) -> dict:
    """Zeros of the trainable weights' shapes (the restore template; no compute)."""
    cfg = head_config(target.config, recipe.layers, recipe.intermediate)
    abstract = nnx.eval_shape(lambda: FeatureHead(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
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
    ``teacher_logits``/``states`` at positions ``1..T-1`` against the head's outputs."""
    token, kl, ce, agree = losses(teacher_logits, head_logits, recipe.ce_weight)
    feat = jnp.mean(smooth_l1(g, states), axis=-1)
    return recipe.feature_weight * feat + recipe.token_weight * token, kl, ce, agree, feat


@functools.partial(jax.jit, static_argnames=("tnet", "dnet", "recipe"), donate_argnums=(0, 1))
def feature_step(train, opt_state, shared, tflat, tokens, step, total, *, tnet, dnet, recipe):
    """One optimizer step on ``tokens`` [B, T]: the target's states and logits, the head's
    forward on the noisy pairs, EAGLE-1's loss, AdamW."""
    logits, states = full_logits(tnet, tflat, tokens, (FINAL,))
    logits, states = jax.lax.stop_gradient((logits, states))
    dtype = tnet.dtype
    key = jax.random.fold_in(jax.random.key(17), step)  # the same noise on a resumed run
    inputs = states[:, :-1]
    noise = recipe.noise * (jax.random.uniform(key, inputs.shape, jnp.float32) - 0.5)
    inputs = (inputs.astype(jnp.float32) + noise).astype(dtype)

    def loss_fn(w):
        params = _assemble(jax.tree.map(lambda x: x.astype(dtype), w), shared)
        head_logits, g = head_forward(dnet, jax.tree.leaves(params), tokens[:, 1:], inputs)
        loss, kl, ce, agree, feat = feature_losses(
            logits[:, 1:], states[:, 1:], head_logits, g, recipe
        )
        metrics = {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean(), "feat": feat.mean()}
        return loss.mean(), metrics

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
    train, opt_state, lr = apply_grads(train, opt_state, grads, step, total, recipe)
    return train, opt_state, {"loss": loss, "lr": lr, **aux}
