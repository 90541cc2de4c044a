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
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jaxspec.api import generate
from jaxspec.errors import CheckpointError, DraftError, OptionError
from jaxspec.io.convert import _int_keys as int_keys
from jaxspec.io.convert import _np_dtype as np_dtype
from jaxspec.io.convert import _str_keys as str_keys
from jaxspec.io.datasets import humaneval
from jaxspec.io.draft_checkpoint import (
    PathLike,
    _assemble,
    _read_json,
    _same_target,
    _shared_of,
    _write_atomic,
    _write_draft,
    draft_config,
    fingerprint,
    load_draft,
)
from jaxspec.model.feature_head import abstract_head
from jaxspec.model.transformer import Model, Net, abstract_model
from jaxspec.train.data import (
    HOLDOUT,
    DataSpec,
    _batch,
    _load_data,
    _spec_json,
    _windows,
    generate_data,
    source_counts,
)
from jaxspec.train.feature import feature_step, head_shapes, init_head, reads_of
from jaxspec.train.init_from import training_of, weights_from
from jaxspec.train.recipe import (
    DATA_FIELDS,
    RECIPE_FIELDS,
    TRAIN_KERNELS,
    Optim,
    Recipe,
    _check_options,
    _optimizer,
    init_draft,
    init_draft_shapes,
    train_step,
)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What differs between the draft kinds a run trains: the trainable weights' init and
    shapes, the network's template, the jitted step, and the recipe defaults of the kind."""

    init: Callable  # (target, recipe) -> float32 pure dict of the trainable weights
    shapes: Callable  # (target, recipe) -> zeros of their shapes
    graph: Callable  # (config, dtype, reads) -> (graphdef, abstract params)
    step: Callable  # the jitted optimizer step, as recipe.train_step
    defaults: dict  # recipe values of this kind where the caller gives none


KINDS = {
    "model": Kind(
        init_draft, init_draft_shapes, lambda cfg, dtype, _: abstract_model(cfg, dtype),
        train_step, {},
    ),
    # EAGLE-1: one decoder layer over the target's states (train.feature)
    "feature": Kind(
        init_head, head_shapes, abstract_head, feature_step, {"layers": 1, "init": "random"}
    ),
}  # fmt: skip


@dataclasses.dataclass
class DistillResult:
    path: pathlib.Path  # the draft folder (load_draft takes it)
    steps: int  # optimizer steps done in total
    total_steps: int
    history: list[dict]  # per step of this call: step, loss, kl, ce, agree, lr
    data: dict  # the data description
    stopped: str | None  # "budget" / "until_step" when the run stopped before total_steps

    @property
    def too_brief(self) -> bool:
        """Fewer steps than a warmup: the learning rate never reached its peak, and such a draft
        was measured at 2.7% token agreement (a budget of 60 s for the default model on CPU)."""
        return self.steps < BRIEF_STEPS


BRIEF_STEPS = 40  # Recipe().warmup


def measured_acceptance(target: Model, path, *, prompts: int = 2, new: int = 24) -> float:
    """Pooled tokens per verification of the draft at ``path``: chain, gamma 4, greedy, on the
    first held-out HumanEval prompts (never trained on)."""
    draft = load_draft(path, target)
    texts = humaneval(prompts)
    r = generate(target, texts, draft=draft, method="chain", gamma=4, max_new_tokens=new)
    return r.stats["acceptance_length"]


def _checkpoint_manager(path: pathlib.Path):
    return ocp.CheckpointManager(
        path.absolute(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False
        ),
    )


def _state_tree(train, opt_state, step, position, total) -> dict:
    return {
        "params": str_keys(train),
        "opt": {str(i): x for i, x in enumerate(jax.tree.leaves(opt_state))},
        "step": np.asarray(step, np.int64),
        "data_position": np.asarray(position, np.int64),
        "total_steps": np.asarray(total, np.int64),
    }


@dataclasses.dataclass
class _State:
    """The training state between phases: weights, optimizer, position in the data."""

    train: dict
    opt_state: object
    step: int
    position: int
    total: int
    fixed_total: bool  # the step count is final (a budget fixes it from measured steps)


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
    _check_call(target, options, budget_s, until_step, save_every)
    store_dtype = np_dtype(dtype)
    out = pathlib.Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise OptionError(f"{out} exists and is not a folder; choose another --out.")
    recipe, spec, fp = _run_description(target, out, resume, options, command)
    deadline = None if budget_s is None else t_start + float(budget_s)
    gen_by = None  # the data generation's deadline
    if deadline is not None:
        gen_by = t_start + (gen_budget_s if gen_budget_s is not None else 0.4 * budget_s)
    windows, meta, counts = _data(target, out / "data", spec, recipe, prompts, gen_by, progress)
    dcfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    mngr = _checkpoint_manager(out / "train")
    st = _restore_or_init(target, recipe, mngr, out, resume, fixed_total=deadline is None)
    history, stopped = _train(target, recipe, dcfg, windows, st, mngr, deadline, until_step,
                              save_every, progress)  # fmt: skip
    if stopped == "until_step":
        return DistillResult(out / "draft", st.step, st.total, history, meta, stopped)
    reads = reads_of(target, recipe) if recipe.kind == "feature" else None
    path = _write_draft(
        out / "draft", dcfg, st.train, store_dtype, fp, kind=recipe.kind, token_counts=counts,
        reads=reads,
        training={
            "recipe": dataclasses.asdict(recipe), "data": meta, "steps": st.step,
            "total_steps": st.total, "tokens_seen": st.step * recipe.batch * recipe.seq_len,
            "stopped": stopped, "last_steps": _summary(history[-20:]),
            "held_out": dict(HOLDOUT), "command": command,
            **_earlier_stages(out),
        },
    )  # fmt: skip
    return DistillResult(path, st.step, st.total, history, meta, stopped)


def _earlier_stages(out: pathlib.Path) -> dict:
    """``init_from_training``: the training record of the draft the run started from, as
    ``run.json`` took it when the run began (nothing for a run from random weights)."""
    run = _read_json(out / "run.json", "run description")
    return {"init_from_training": run["init_from_training"]} if "init_from_training" in run else {}


def _check_call(target, options, budget_s, until_step, save_every) -> None:
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


def _given(options: dict) -> tuple[dict, dict]:
    """The recipe and data options the caller gave (the rest stay at their defaults)."""
    recipe = {k: v for k, v in options.items() if k in RECIPE_FIELDS}
    data = {k: v for k, v in options.items() if k in DATA_FIELDS - {"seed"}}
    if "data_seed" in options:
        data["seed"] = options["data_seed"]
    if "data" in data:
        sets = data["data"]
        sets = tuple(s for s in (sets.split(",") if isinstance(sets, str) else sets) if s)
        if not sets:
            raise OptionError("data must name at least one prompt set, e.g. 'humaneval,chat'.")
        data["data"] = sets
    return recipe, data


def _run_description(target, out, resume, options, command):
    """(recipe, data spec, target fingerprint): a new run's, written to ``out/run.json``, or the
    resumed run's, checked against the options given now and the target."""
    run_file = out / "run.json"
    given_recipe, given_data = _given(options)
    fp = fingerprint(target)
    if not resume:
        if (out / "train").exists() or (out / "draft").exists():
            raise OptionError(
                f"{out} already holds a distill run; pass resume=True (CLI: --resume) to "
                "continue it, or choose another --out."
            )
        kind = given_recipe.get("kind", "model")
        if kind not in KINDS:  # before its defaults are looked up (``_check_options`` after)
            raise OptionError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}.")
        defaults = KINDS[kind].defaults
        recipe, spec = Recipe(**{**defaults, **given_recipe}), DataSpec(**given_data)
        _check_options(recipe, spec, target)
        out.mkdir(parents=True, exist_ok=True)
        run = {"recipe": dataclasses.asdict(recipe), "data": _spec_json(spec), "target": fp,
               "command": command}  # fmt: skip
        if recipe.init_from is not None:
            run["init_from_training"] = training_of(recipe.init_from)
        _write_atomic(run_file, json.dumps(run, indent=2))
        return recipe, spec, fp
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
    _check_options(recipe, spec, target)
    return recipe, spec, fp


def _data(target, data_dir, spec, recipe, prompts, deadline, progress):
    """The training windows ``[N, seq_len]``, the data's description and its token counts:
    generated by the target (within ``deadline``) or, on a resume, read back."""
    if (data_dir / "meta.json").is_file():
        stream, meta = _load_data(data_dir)
        if meta.get("spec") != _spec_json(spec):
            raise OptionError(
                f"{data_dir} was generated with other data options; remove it or choose "
                "another --out."
            )
    else:
        generate_data(target, data_dir, spec, prompts=prompts, deadline=deadline,
                      progress=progress)  # fmt: skip
        stream, meta = _load_data(data_dir)
    windows = _windows(stream, recipe.seq_len)
    if windows.shape[0] < recipe.batch:
        raise OptionError(
            f"the data holds {stream.size} tokens: fewer than one batch of {recipe.batch} "
            f"windows of {recipe.seq_len}; lower batch or seq_len, or generate more "
            "(samples, max_new, more prompts)."
        )
    return windows, meta, source_counts(data_dir, stream, meta, target.config.vocab_size)


def _restore_or_init(target, recipe, mngr, out, resume, *, fixed_total) -> _State:
    opt = _optimizer(Optim.of(recipe))
    latest = mngr.latest_step() if resume else None
    if latest is None:
        train = (
            KINDS[recipe.kind].init(target, recipe)
            if recipe.init_from is None
            else weights_from(target, recipe, KINDS[recipe.kind].init)
        )
        return _State(train, opt.init(train), 0, 0, recipe.steps, fixed_total)
    train0 = KINDS[recipe.kind].shapes(target, recipe)
    opt0 = opt.init(train0)
    try:
        st = mngr.restore(latest, args=ocp.args.StandardRestore(_state_tree(train0, opt0, 0, 0, 0)))
    except Exception as e:
        raise CheckpointError(
            f"could not restore the training checkpoint {latest} in {out / 'train'} "
            f"({type(e).__name__}); remove that step folder to fall back to an earlier one."
        ) from None
    train = jax.tree.map(jnp.asarray, int_keys(st["params"]))
    leaves = [jnp.asarray(st["opt"][str(i)]) for i in range(len(st["opt"]))]
    opt_state = jax.tree.unflatten(jax.tree.structure(opt0), leaves)
    return _State(
        train, opt_state, int(st["step"]), int(st["data_position"]), int(st["total_steps"]), True
    )


# Steps whose median time fixes the step count under a budget: the whole warmup (the learning
# rate does not depend on the count until it ends). On the H200 the first steps after the
# compile ran several times slower than the steady 16 steps/s, and 5 of them fixed 128 steps
# where the budget had room for over a thousand.
MIN_MEASURED_STEPS = 3
RESERVE_S = 5.0  # kept for the last checkpoint and the draft's write


def _train(target, recipe, dcfg, windows, st, mngr, deadline, until_step, save_every, progress):
    """Optimizer steps until the recipe's (or the budget's) count, ``until_step`` or the
    deadline; checkpoints every ``save_every`` steps and at the end. Returns (history, why it
    stopped early: "budget", "until_step" or None)."""
    shared = _shared_of(target)
    kind = KINDS[recipe.kind]
    reads = reads_of(target, recipe) if recipe.kind == "feature" else None
    dgraph = kind.graph(dcfg, target.dtype, reads)[0]
    dstate = _assemble(jax.tree.map(lambda x: x.astype(target.dtype), st.train), shared)
    dnet = Net(
        dgraph, dcfg, TRAIN_KERNELS.resolve(dcfg), jax.tree.structure(dstate),
        jnp.dtype(target.dtype).name,
    )  # fmt: skip
    static = dict(tnet=target.net(), dnet=dnet, recipe=Optim.of(recipe))
    measure = max(MIN_MEASURED_STEPS, recipe.warmup)
    tokens_per_step = recipe.batch * recipe.seq_len
    history, stopped, ends, last_saved = [], None, [], st.step
    bar = tqdm(total=st.total, initial=st.step, desc="distill", unit="step", disable=not progress)
    with bar:
        t_prev = time.perf_counter()
        while st.step < st.total:
            if until_step is not None and st.step >= until_step:
                stopped = "until_step"
                break
            per_step = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) >= 2 else 0.0
            if (
                deadline is not None
                and ends
                and time.perf_counter() + per_step + RESERVE_S > deadline
            ):
                stopped = "budget"
                break
            tokens = jnp.asarray(_batch(windows, st.position, recipe.batch, recipe.seed))
            st.train, st.opt_state, m = kind.step(
                st.train, st.opt_state, shared, target.flat, tokens, st.step, st.total, **static
            )
            m = {k: float(v) for k, v in m.items()}  # waits for the step
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            ends.append(now)
            st.step += 1
            st.position += recipe.batch
            history.append({"step": st.step, **m})
            if not st.fixed_total and len(ends) >= measure:
                left = max(0.0, deadline - now - RESERVE_S)
                per_step = float(np.median(np.diff(ends)))
                st.total = max(st.step, min(recipe.steps, st.step + int(left / per_step)))
                st.fixed_total = True
                bar.total = st.total
                bar.refresh()
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", agree=f"{m['agree']:.3f}",
                            tok_s=f"{tokens_per_step / max(dt, 1e-9):.0f}")  # fmt: skip
            if st.step % save_every == 0 and st.step < st.total:
                mngr.save(st.step, args=_save_args(st.train, st.opt_state, st.step, st.position,
                                                   st.total))  # fmt: skip
                last_saved = st.step
        if not st.fixed_total:  # the budget ran out before the step count was fixed
            st.total = st.step
    if st.step != last_saved or mngr.latest_step() is None:
        args = _save_args(st.train, st.opt_state, st.step, st.position, st.total)
        mngr.save(st.step, args=args, force=True)
    mngr.wait_until_finished()
    mngr.close()
    return history, stopped


def _save_args(train, opt_state, step, position, total):
    return ocp.args.StandardSave(_state_tree(train, opt_state, step, position, total))


def _summary(rows: list[dict]) -> dict:
    if not rows:
        return {}
    keys = [k for k in ("loss", "kl", "agree", "agree_last") if k in rows[0]]
    return {k: round(float(np.mean([r[k] for r in rows])), 5) for k in keys}
