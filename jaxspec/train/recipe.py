"""The distillation recipe: its options, the draft's initialisation from the target, the losses
and the jitted train step (``train.distill`` runs them)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.errors import OptionError
from jaxspec.io.draft_checkpoint import _assemble, _pure, _trainable, draft_config
from jaxspec.kernels import KernelConfig
from jaxspec.model.feature_head import parse_reads
from jaxspec.model.quantized import dequantize_params
from jaxspec.model.transformer import Model, abstract_model, full_logits, new_model
from jaxspec.train.data import DataSpec


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that determines the trained weights; ``resume`` must see the same values."""

    layers: int = 2
    intermediate: int = 512
    init: str = "copy"  # "copy": the target's first layers; "copy-spread"; "random"
    seq_len: int = 512
    batch: int = 16
    steps: int = 1000  # the most steps; a budget may fix fewer before warmup ends
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.01
    clip: float = 1.0
    ce_weight: float = 0.25
    seed: int = 0
    kind: str = "model"  # "model": a small decoder; "feature": an EAGLE head (train.feature)
    feature_weight: float = 1.0  # feature kind: the state regression's weight (EAGLE-1's)
    token_weight: float = 0.1  # feature kind: the token loss's weight (EAGLE-1's)
    noise: float = 0.2  # feature kind: width of the uniform noise on the input states
    ttt_steps: int = 1  # feature kind: runs of the head on its own states (train.feature)
    init_from: str | None = None  # a finished draft of this kind and width, as deep or shallower
    reads: str = "final"  # feature kind: the target states the head reads ("1,14,final": fused)


@dataclasses.dataclass(frozen=True)
class Optim:
    """The part of a Recipe the compiled train step depends on (other values do not recompile)."""

    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    clip: float
    ce_weight: float
    feature_weight: float
    token_weight: float
    noise: float
    ttt_steps: int
    reads: str

    @classmethod
    def of(cls, recipe: Recipe) -> Optim:
        return cls(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(cls)})


INITS = ("copy", "copy-spread", "random")
KINDS = ("model", "feature")
RECIPE_FIELDS = {f.name for f in dataclasses.fields(Recipe)}
DATA_FIELDS = {f.name for f in dataclasses.fields(DataSpec)}


def _check_options(recipe: Recipe, spec: DataSpec, target: Model) -> None:
    def pos_int(name, v, lo=1):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise OptionError(f"{name} must be an integer >= {lo}, got {v!r}.")

    def pos_float(name, v, lo=0.0, strict=True, hi=None):
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v > lo if strict else v >= lo) and (hi is None or v <= hi)
        if not ok:
            rng = f"{'>' if strict else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise OptionError(f"{name} must be a number {rng}, got {v!r}.")

    for name in ("layers", "intermediate", "seq_len", "batch", "steps"):
        pos_int(name, getattr(recipe, name))
    for name in ("warmup", "seed"):
        pos_int(name, getattr(recipe, name), lo=0)
    pos_int("ttt_steps", recipe.ttt_steps)
    if recipe.ttt_steps > 1 and recipe.kind != "feature":
        raise OptionError(
            f"ttt_steps={recipe.ttt_steps}: the training-time test runs a feature head on its own "
            "states; a small draft ('model' kind) drafts on tokens. Use --kind feature or leave "
            "ttt_steps at 1."
        )
    if recipe.init_from is not None and not isinstance(recipe.init_from, str):
        raise OptionError(f"init_from must be a draft folder's path, got {recipe.init_from!r}.")
    pos_float("lr", recipe.lr)
    pos_float("min_lr_ratio", recipe.min_lr_ratio, strict=False, hi=1.0)
    pos_float("weight_decay", recipe.weight_decay, strict=False)
    pos_float("clip", recipe.clip)
    for name in ("ce_weight", "feature_weight", "token_weight", "noise"):
        pos_float(name, getattr(recipe, name), strict=False)
    if recipe.kind not in KINDS:
        raise OptionError(f"kind must be one of {', '.join(KINDS)}, got {recipe.kind!r}.")
    if recipe.init not in INITS:
        raise OptionError(f"init must be one of {', '.join(INITS)}, got {recipe.init!r}.")
    if recipe.kind == "feature" and recipe.init != "random":
        raise OptionError(
            f"init={recipe.init!r}: a feature head starts from random weights (EAGLE-1's); "
            "pass init='random' or leave it unset."
        )
    cfg = target.config
    if recipe.kind == "feature":
        parse_reads(recipe.reads, cfg.num_layers)
    elif recipe.reads != "final":
        raise OptionError(
            f"reads={recipe.reads!r}: a small draft ('model' kind) reads tokens, not the "
            "target's states. Use --kind feature or leave reads unset."
        )
    if recipe.seq_len + 1 > cfg.max_position_embeddings:
        raise OptionError(
            f"seq_len={recipe.seq_len} does not fit the target's context of "
            f"{cfg.max_position_embeddings} tokens; lower it."
        )
    if recipe.init != "random" and recipe.layers > cfg.num_layers:
        raise OptionError(
            f"init={recipe.init!r} takes layers from the target, which has {cfg.num_layers}; "
            f"ask for at most {cfg.num_layers} layers or use init='random'."
        )
    if recipe.init != "random" and recipe.intermediate > cfg.intermediate_size:
        raise OptionError(
            f"init={recipe.init!r} trims the target's MLP of {cfg.intermediate_size} units; "
            f"intermediate must be at most that, got {recipe.intermediate}."
        )
    for name in ("samples", "seed"):
        pos_int(name, getattr(spec, name), lo=0)
    for name in ("max_new", "gen_batch", "max_prompt_tokens"):
        pos_int(name, getattr(spec, name))
    pos_float("temperature", spec.temperature)
    if spec.max_new >= cfg.max_position_embeddings:
        raise OptionError(
            f"max_new={spec.max_new} leaves no room for a prompt in the target's context of "
            f"{cfg.max_position_embeddings} tokens; lower it."
        )


# ------------------------------------------------------------------------------ fingerprint


# ------------------------------------------------------------------------------ draft model


def init_draft(target: Model, recipe: Recipe) -> dict:
    """The draft's trainable weights (float32 pure dict): copied target layers (a quantized
    target's dequantized) or random."""
    cfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    tp = dequantize_params(_pure(target.params))
    if recipe.init == "random":
        pure = _pure(new_model(cfg, seed=recipe.seed).params)
        pure["norm"] = tp["norm"]
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _trainable(pure))
    n_t = target.config.num_layers
    if recipe.init == "copy-spread":
        picks = np.linspace(0, n_t - 1, recipe.layers).round().astype(int).tolist()
    else:
        picks = list(range(recipe.layers))
    layers = {}
    for i, src in enumerate(picks):
        layer = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), tp["layers"][src])
        mlp = layer["mlp"]
        g, u, d = mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"]
        score = np.linalg.norm(g, axis=0) * np.linalg.norm(u, axis=0) * np.linalg.norm(d, axis=1)
        keep = np.sort(np.argsort(-score, kind="stable")[: recipe.intermediate])
        layer["mlp"] = {
            "gate_proj": {"kernel": g[:, keep]},
            "up_proj": {"kernel": u[:, keep]},
            "down_proj": {"kernel": d[keep, :]},
        }
        layers[i] = layer
    norm = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), tp["norm"])
    return jax.tree.map(jnp.asarray, {"layers": layers, "norm": norm})


# ------------------------------------------------------------------------------ data


# ------------------------------------------------------------------------------ training


# The draft trains through the pure-jnp attention and the plain projections: they have a
# gradient (the Pallas kernels do not).
TRAIN_KERNELS = KernelConfig(
    attention="reference",
    prefill_attention="off",
    fused_attention="off",
    fused_linear="off",
    fused_commit="off",
)


def lr_at(step, total, recipe: Recipe | Optim):
    """Linear warmup to ``lr``, then cosine to ``min_lr_ratio * lr`` at ``total``."""
    step = jnp.asarray(step, jnp.float32)
    total = jnp.asarray(total, jnp.float32)
    warm = jnp.float32(max(recipe.warmup, 1))
    peak, low = recipe.lr, recipe.lr * recipe.min_lr_ratio
    frac = jnp.clip((step - recipe.warmup) / jnp.maximum(total - recipe.warmup, 1.0), 0.0, 1.0)
    cos = low + (peak - low) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return jnp.where(step < recipe.warmup, peak * (step + 1) / warm, cos)


def _optimizer(recipe: Recipe | Optim):
    def decay_mask(p):
        return jax.tree.map(lambda x: x.ndim > 1, p)

    return optax.chain(
        optax.clip_by_global_norm(recipe.clip),
        optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=recipe.lr,
            b1=0.9,
            b2=0.95,
            weight_decay=recipe.weight_decay,
            mask=decay_mask,
        ),
    )


def losses(teacher_logits, draft_logits, ce_weight: float):
    """Per-position KL(teacher || draft), CE on the teacher's greedy token, top-1 agreement."""
    lp = jax.nn.log_softmax(teacher_logits, axis=-1)
    lq = jax.nn.log_softmax(draft_logits, axis=-1)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
    best = jnp.argmax(teacher_logits, axis=-1)
    ce = -jnp.take_along_axis(lq, best[..., None], axis=-1)[..., 0]
    agree = (jnp.argmax(draft_logits, axis=-1) == best).astype(jnp.float32)
    return kl + ce_weight * ce, kl, ce, agree


@functools.partial(jax.jit, static_argnames=("tnet", "dnet", "recipe"), donate_argnums=(0, 1))
def train_step(train, opt_state, shared, tflat, tokens, step, total, *, tnet, dnet, recipe):
    """One optimizer step on ``tokens`` [B, T]: teacher forward, draft forward and backward."""
    teacher = jax.lax.stop_gradient(full_logits(tnet, tflat, tokens))
    dtype = tnet.dtype

    def loss_fn(w):
        params = _assemble(jax.tree.map(lambda x: x.astype(dtype), w), shared)
        draft_logits = full_logits(dnet, jax.tree.leaves(params), tokens)
        loss, kl, ce, agree = losses(teacher, draft_logits, recipe.ce_weight)
        return loss.mean(), {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean()}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
    train, opt_state, lr = apply_grads(train, opt_state, grads, step, total, recipe)
    return train, opt_state, {"loss": loss, "lr": lr, **aux}


def apply_grads(train, opt_state, grads, step, total, recipe: Optim):
    """One AdamW update at the scheduled learning rate: ``(train, opt_state, lr)``."""
    clip_state, adam_state = opt_state
    lr = lr_at(step, total, recipe)
    adam_state = adam_state._replace(hyperparams={**adam_state.hyperparams, "learning_rate": lr})
    updates, opt_state = _optimizer(recipe).update(grads, (clip_state, adam_state), train)
    return optax.apply_updates(train, updates), opt_state, lr


def init_draft_shapes(target: Model, recipe: Recipe) -> dict:
    """Abstract float32 shapes of the trainable weights (no compute)."""
    cfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    _, st = abstract_model(cfg, jnp.float32)
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), _trainable(_pure(st)))
