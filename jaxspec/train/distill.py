"""Distil a small draft for a target: ``jaxspec distill`` and ``jaxspec.load_draft``.

A distilled draft is a normal ``jaxspec.Model`` (Llama architecture) with the target's
vocabulary, hidden size and attention heads but few decoder layers and a narrower MLP. It
**shares** the target's embedding (and LM head when the target has one): those are not stored
in the draft checkpoint, they are filled from the target when the draft is loaded and frozen
during training. The checkpoint records which target it belongs to (a fingerprint of the
embedding), and ``load_draft`` with another target raises ``DraftError``.

Recipe (``distill``):

1. **Data**: the target itself writes the text. Real prompts (``data``: dataset names from
   ``jaxspec.io.datasets``; sets of user turns get the chat template; ``NAME@chat`` / ``NAME@raw``
   force it) are decoded by the target's own batched autoregressive engine: one greedy
   continuation per prompt, then ``samples`` passes at ``temperature``. The first
   ``HOLDOUT["humaneval"] = 20`` HumanEval prompts, the ones the benchmarks measure, are **never**
   used. Each document is prompt + continuation; the documents are concatenated and cut into
   windows of ``seq_len`` tokens. Stored in ``OUT/data/`` (reused by ``--resume``).
2. **Init** (``init="copy"``): the draft's layers are copies of the target's first layers, each
   MLP trimmed to the ``intermediate`` units with the largest ``|gate| * |up| * |down|`` weight
   norms, and the target's final norm. On SmolLM2-135M-Instruct (HumanEval text, before
   training) layers 0-1 gave KL 14.9 nats and 15% top-1 agreement; layers 0 and 29
   (``init="copy-spread"``: spread over the depth, first and last) gave KL 72 and 0%: the last
   layer expects the residual stream of layer 28, not of layer 0. ``init="random"`` also exists.
3. **Training**: in one jitted step the target's forward gives the teacher logits on the fly;
   the loss is ``KL(target || draft)`` over the full vocabulary plus ``ce_weight`` times the
   cross-entropy of the draft on the target's greedy token, averaged over positions. AdamW (weight
   decay on matrices only), global-norm clipping, linear warmup then cosine decay to
   ``min_lr_ratio * lr``. The trainable weights are float32 masters; forwards run in the target's
   dtype.
4. **Checkpoints**: Orbax checkpoints of the trainable weights, optimizer state, step, data
   position and total steps in ``OUT/train/`` every ``save_every`` steps and at the end;
   ``resume=True`` continues from the last one and reaches the same weights as an uninterrupted
   run. With ``budget_s`` the whole call (data + training) stops in time: the number of steps is
   fixed from the measured step time before warmup ends, so the schedule still completes.
5. **Output**: the draft in ``OUT/draft/`` (``draft.json`` + ``params/``, bfloat16 by default),
   written atomically: a temporary folder renamed into place.

``load_draft(path, target)`` returns the ``Model`` to pass as ``draft=`` to every engine.

This module holds the recipe and the training loop; ``jaxspec.train.data`` the data stage and
``jaxspec.io.draft_checkpoint`` the draft format, fingerprint and loader (re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import CheckpointError, DraftError, OptionError
from jaxspec.io.draft_checkpoint import (
    PathLike,
    _assemble,
    _pure,
    _read_json,
    _same_target,
    _shared_of,
    _trainable,
    _write_atomic,
    _write_draft,
    draft_config,
    fingerprint,
)
from jaxspec.kernels import KernelConfig
from jaxspec.model.transformer import Model, Net, abstract_model, full_logits, new_model
from jaxspec.train.data import (
    HOLDOUT,
    DataSpec,
    _batch,
    _load_data,
    _spec_json,
    _windows,
    generate_data,
)

# ------------------------------------------------------------------------------ options


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


@dataclasses.dataclass(frozen=True)
class Optim:
    """The part of a Recipe the compiled train step depends on (other values do not recompile)."""

    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    clip: float
    ce_weight: float

    @classmethod
    def of(cls, recipe: Recipe) -> Optim:
        return cls(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(cls)})


INITS = ("copy", "copy-spread", "random")
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
    pos_float("lr", recipe.lr)
    pos_float("min_lr_ratio", recipe.min_lr_ratio, strict=False, hi=1.0)
    pos_float("weight_decay", recipe.weight_decay, strict=False)
    pos_float("clip", recipe.clip)
    pos_float("ce_weight", recipe.ce_weight, strict=False)
    if recipe.init not in INITS:
        raise OptionError(f"init must be one of {', '.join(INITS)}, got {recipe.init!r}.")
    cfg = target.config
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
    """The draft's trainable weights (float32 pure dict): copied target layers or random."""
    cfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    if recipe.init == "random":
        pure = _pure(new_model(cfg, seed=recipe.seed).params)
        tp = _pure(target.params)
        pure["norm"] = tp["norm"]
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _trainable(pure))
    tp = _pure(target.params)
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
    attention="reference", fused_attention="off", fused_linear="off", fused_commit="off"
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
    import optax

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
    import optax

    teacher = jax.lax.stop_gradient(full_logits(tnet, tflat, tokens))
    dtype = tflat[0].dtype

    def loss_fn(w):
        params = _assemble(jax.tree.map(lambda x: x.astype(dtype), w), shared)
        draft_logits = full_logits(dnet, jax.tree.leaves(params), tokens)
        loss, kl, ce, agree = losses(teacher, draft_logits, recipe.ce_weight)
        return loss.mean(), {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean()}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
    clip_state, adam_state = opt_state
    lr = lr_at(step, total, recipe)
    adam_state = adam_state._replace(hyperparams={**adam_state.hyperparams, "learning_rate": lr})
    updates, opt_state = _optimizer(recipe).update(grads, (clip_state, adam_state), train)
    train = optax.apply_updates(train, updates)
    return train, opt_state, {"loss": loss, "lr": lr, **aux}


@dataclasses.dataclass
class DistillResult:
    path: pathlib.Path  # the draft folder (load_draft takes it)
    steps: int  # optimizer steps done in total
    total_steps: int
    history: list[dict]  # per step of this call: step, loss, kl, ce, agree, lr
    data: dict  # the data description
    stopped: str | None  # "budget" / "until_step" when the run stopped before total_steps


def _checkpoint_manager(path: pathlib.Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        path.absolute(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False
        ),
    )


def _state_tree(train, opt_state, step, position, total) -> dict:
    from jaxspec.io.convert import _str_keys

    return {
        "params": _str_keys(train),
        "opt": {str(i): x for i, x in enumerate(jax.tree.leaves(opt_state))},
        "step": np.asarray(step, np.int64),
        "data_position": np.asarray(position, np.int64),
        "total_steps": np.asarray(total, np.int64),
    }


def distill(
    target: Model,
    out: PathLike,
    *,
    prompts=None,
    resume: bool = False,
    budget_s: float | None = None,
    gen_budget_s: float | None = None,
    until_step: int | None = None,
    save_every: int = 100,
    dtype: str = "bfloat16",
    progress: bool = True,
    command: str | None = None,
    **options: Any,
) -> DistillResult:
    """Distil a draft for ``target`` into ``out`` (see the module docstring for the recipe).

    options: the fields of ``Recipe`` (layers, intermediate, init, seq_len, batch, steps, lr,
    min_lr_ratio, warmup, weight_decay, clip, ce_weight, seed) and ``DataSpec`` (data, samples,
    temperature, max_new, gen_batch, max_prompt_tokens, data_seed).
    prompts: instead of ``data``, these prompts (strings or token-id lists).
    resume: continue the run in ``out`` from its last checkpoint (the options must match).
    budget_s: the whole call stops within about this many seconds (data generation gets at most
    ``gen_budget_s``, by default 40% of it); the step count is fixed from the measured step time.
    until_step: stop after this step (a later ``resume=True`` continues).
    dtype: the stored draft's dtype. Returns a ``DistillResult``; the draft is ``result.path``.
    """
    t_start = time.perf_counter()
    if not isinstance(target, Model):
        raise OptionError(
            f"target must be a jaxspec.Model (from jaxspec.load), got {type(target).__name__}."
        )
    unknown = sorted(set(options) - RECIPE_FIELDS - DATA_FIELDS - {"data_seed"})
    if unknown:
        raise OptionError(
            f"distill does not take {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(RECIPE_FIELDS | DATA_FIELDS - {'seed'} | {'data_seed'}))}."
        )
    if budget_s is not None and not (isinstance(budget_s, int | float) and budget_s > 0):
        raise OptionError(f"budget_s must be a positive number of seconds, got {budget_s!r}.")
    if until_step is not None and (not isinstance(until_step, int) or until_step < 1):
        raise OptionError(f"until_step must be a positive integer, got {until_step!r}.")
    if not isinstance(save_every, int) or save_every < 1:
        raise OptionError(f"save_every must be a positive integer, got {save_every!r}.")
    from jaxspec.io.convert import _np_dtype

    store_dtype = _np_dtype(dtype)
    out = pathlib.Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise OptionError(f"{out} exists and is not a folder; choose another --out.")
    run_file = out / "run.json"
    given_recipe = {k: v for k, v in options.items() if k in RECIPE_FIELDS}
    given_data = {k: v for k, v in options.items() if k in DATA_FIELDS - {"seed"}}
    if "data_seed" in options:
        given_data["seed"] = options["data_seed"]
    if "data" in given_data:
        data = given_data["data"]
        data = tuple(s for s in (data.split(",") if isinstance(data, str) else data) if s)
        if not data:
            raise OptionError("data must name at least one prompt set, e.g. 'humaneval,chat'.")
        given_data["data"] = data

    fp = fingerprint(target)
    if resume:
        if not run_file.is_file():
            raise CheckpointError(
                f"nothing to resume in {out} (no run.json); start the run without --resume."
            )
        run = _read_json(run_file, "run description")
        recipe = Recipe(**run["recipe"])
        spec = DataSpec(**{**run["data"], "data": tuple(run["data"]["data"])})
        for k, v in given_recipe.items():
            if getattr(recipe, k) != v:
                raise OptionError(
                    f"the run in {out} was started with {k}={getattr(recipe, k)!r}; resume "
                    f"with the same value (or none), not {v!r}, or start a new --out."
                )
        for k, v in given_data.items():
            if getattr(spec, k) != v:
                raise OptionError(
                    f"the run in {out} generated its data with {k}={getattr(spec, k)!r}; "
                    f"resume with the same value (or none), not {v!r}."
                )
        why = _same_target(run["target"], target)
        if why is not None:
            raise DraftError(f"the run in {out} distils for another target ({why}).")
    else:
        if (out / "train").exists() or (out / "draft").exists():
            raise OptionError(
                f"{out} already holds a distill run; pass resume=True (CLI: --resume) to "
                "continue it, or choose another --out."
            )
        recipe = Recipe(**given_recipe)
        spec = DataSpec(**given_data)
    _check_options(recipe, spec, target)
    deadline = None if budget_s is None else t_start + float(budget_s)
    if not resume:
        out.mkdir(parents=True, exist_ok=True)
        run = {
            "recipe": dataclasses.asdict(recipe),
            "data": _spec_json(spec),
            "target": fp,
            "command": command,
        }
        _write_atomic(run_file, json.dumps(run, indent=2))

    # ---- data
    data_dir = out / "data"
    if (data_dir / "meta.json").is_file():
        stream, meta = _load_data(data_dir)
        if meta.get("spec") != _spec_json(spec):
            raise OptionError(
                f"{data_dir} was generated with other data options; remove it or choose "
                "another --out."
            )
    else:
        gen_deadline = None
        if deadline is not None:
            share = gen_budget_s if gen_budget_s is not None else 0.4 * float(budget_s)
            gen_deadline = t_start + share
        meta = generate_data(
            target, data_dir, spec, prompts=prompts, deadline=gen_deadline, progress=progress
        )
        stream, meta = _load_data(data_dir)
    windows = _windows(stream, recipe.seq_len)
    if windows.shape[0] < recipe.batch:
        raise OptionError(
            f"the data holds {stream.size} tokens: fewer than one batch of {recipe.batch} "
            f"windows of {recipe.seq_len}; lower batch or seq_len, or generate more "
            "(samples, max_new, more prompts)."
        )

    # ---- model, optimizer, state
    dcfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    dgraph = abstract_model(dcfg, target.dtype)[0]
    shared = _shared_of(target)
    opt = _optimizer(Optim.of(recipe))
    mngr = _checkpoint_manager(out / "train")
    latest = mngr.latest_step() if resume else None
    if latest is not None:
        import orbax.checkpoint as ocp

        from jaxspec.io.convert import _int_keys

        train0 = init_draft_shapes(target, recipe)
        opt0 = opt.init(train0)
        try:
            st = mngr.restore(
                latest, args=ocp.args.StandardRestore(_state_tree(train0, opt0, 0, 0, 0))
            )
        except Exception as e:
            raise CheckpointError(
                f"could not restore the training checkpoint {latest} in {out / 'train'} "
                f"({type(e).__name__}); remove that step folder to fall back to an earlier one."
            ) from None
        train = jax.tree.map(jnp.asarray, _int_keys(st["params"]))
        leaves = [jnp.asarray(st["opt"][str(i)]) for i in range(len(st["opt"]))]
        opt_state = jax.tree.unflatten(jax.tree.structure(opt0), leaves)
        step, position, total = int(st["step"]), int(st["data_position"]), int(st["total_steps"])
        fixed_total = True
    else:
        train = init_draft(target, recipe)
        opt_state = opt.init(train)
        step, position, total = 0, 0, recipe.steps
        fixed_total = deadline is None
    tokens_per_step = recipe.batch * recipe.seq_len

    # ---- train
    from tqdm.auto import tqdm

    history: list[dict] = []
    stopped = None
    dstate = _assemble(jax.tree.map(lambda x: x.astype(target.dtype), train), shared)
    dnet = Net(dgraph, dcfg, TRAIN_KERNELS.resolve(dcfg), jax.tree.structure(dstate))
    static = dict(tnet=target.net(), dnet=dnet, recipe=Optim.of(recipe))
    # the step count is fixed while the learning rate does not depend on it yet (warmup), from
    # the median step time over the whole warmup: on the H200 the first steps after the compile
    # ran several times slower than the steady 16 steps/s, and 5 of them fixed 128 steps where
    # the budget had room for over a thousand
    measure = max(3, recipe.warmup)
    reserve = 5.0  # seconds kept for the last checkpoint and the draft's write
    ends: list[float] = []  # step end times; the first step compiles and is not measured
    bar = tqdm(total=total, initial=step, desc="distill", unit="step", disable=not progress)
    last_saved = step
    with bar:
        t_prev = time.perf_counter()
        while step < total:
            if until_step is not None and step >= until_step:
                stopped = "until_step"
                break
            per_step = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) >= 2 else 0.0
            if (
                deadline is not None
                and ends
                and time.perf_counter() + per_step + reserve > deadline
            ):
                stopped = "budget"
                break
            tokens = jnp.asarray(_batch(windows, position, recipe.batch, recipe.seed))
            train, opt_state, m = train_step(
                train, opt_state, shared, target.flat, tokens, step, total, **static
            )
            m = {k: float(v) for k, v in m.items()}  # waits for the step
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            ends.append(now)
            step += 1
            position += recipe.batch
            history.append({"step": step, **m})
            if not fixed_total and len(ends) >= measure:
                per_step = float(np.median(np.diff(ends)))
                left = max(0.0, deadline - now - reserve)
                total = max(step, min(recipe.steps, step + int(left / per_step)))
                fixed_total = True
                bar.total = total
                bar.refresh()
            bar.update(1)
            bar.set_postfix(
                loss=f"{m['loss']:.3f}",
                agree=f"{m['agree']:.3f}",
                tok_s=f"{tokens_per_step / max(dt, 1e-9):.0f}",
            )
            if step % save_every == 0 and step < total:
                mngr.save(step, args=_save_args(train, opt_state, step, position, total))
                last_saved = step
        if not fixed_total:  # the budget ran out before the step count was fixed
            total = step
    if step != last_saved or mngr.latest_step() is None:
        mngr.save(step, args=_save_args(train, opt_state, step, position, total), force=True)
    mngr.wait_until_finished()
    mngr.close()
    if stopped == "until_step":
        path = out / "draft"
    else:
        path = _write_draft(
            out / "draft",
            dcfg,
            train,
            store_dtype,
            fp,
            training={
                "recipe": dataclasses.asdict(recipe),
                "data": meta,
                "steps": step,
                "total_steps": total,
                "tokens_seen": step * tokens_per_step,
                "stopped": stopped,
                "last_steps": _summary(history[-20:]),
                "held_out": {k: v for k, v in HOLDOUT.items()},
                "command": command,
            },
        )
    return DistillResult(path, step, total, history, meta, stopped)


def init_draft_shapes(target: Model, recipe: Recipe) -> dict:
    """Abstract float32 shapes of the trainable weights (no compute)."""
    cfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    _, st = abstract_model(cfg, jnp.float32)
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), _trainable(_pure(st)))


def _save_args(train, opt_state, step, position, total):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(_state_tree(train, opt_state, step, position, total))


def _summary(rows: list[dict]) -> dict:
    if not rows:
        return {}
    return {k: round(float(np.mean([r[k] for r in rows])), 5) for k in ("loss", "kl", "agree")}
