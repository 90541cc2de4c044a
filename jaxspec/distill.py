"""Distil a small draft for a target: ``jaxspec distill`` and ``jaxspec.load_draft``.

A distilled draft is a normal ``jaxspec.Model`` (Llama architecture) with the target's
vocabulary, hidden size and attention heads but few decoder layers and a narrower MLP. It
**shares** the target's embedding (and LM head when the target has one): those are not stored
in the draft checkpoint, they are filled from the target when the draft is loaded and frozen
during training. The checkpoint records which target it belongs to (a fingerprint of the
embedding), and ``load_draft`` with another target raises ``DraftError``.

Recipe (``distill``):

1. **Data**: the target itself writes the text. Real prompts (``data``: dataset names from
   ``jaxspec.datasets``; sets of user turns get the chat template; ``NAME@chat`` / ``NAME@raw``
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, DraftError, OptionError
from jaxspec.model import Model, full_logits

FORMAT = "jaxspec-draft/1"
HOLDOUT = {"humaneval": 20}  # prompts the benchmarks use: never trained on
SHARED = ("embed_tokens", "lm_head")  # filled from the target, not stored, not trained
REPO = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = REPO / "checkpoints" / "drafts" / "smollm2-135m-instruct-draft"
PathLike = str | os.PathLike


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
class DataSpec:
    """How the target writes the training text; ``resume`` reuses what was written."""

    data: tuple[str, ...] = ("humaneval", "chat")
    samples: int = 4  # temperature samples per prompt, besides the greedy continuation
    temperature: float = 0.8
    max_new: int = 256
    gen_batch: int = 64
    max_prompt_tokens: int = 512  # longer prompts keep their last tokens
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


def _shared_arrays(model: Model) -> dict[str, np.ndarray]:
    pure = nnx.to_pure_dict(model.params)
    out = {"embed_tokens": pure["embed_tokens"]}
    if "lm_head" in pure and pure["lm_head"] is not None:
        out["lm_head"] = pure["lm_head"]["kernel"]
    return {k: np.asarray(jax.device_get(v)) for k, v in out.items()}


def fingerprint(target: Model) -> dict:
    """What identifies the target a draft belongs to: vocabulary and hidden sizes, the sha256 of
    the shared arrays' bytes as bfloat16, and a small probe of them (a few rows, float32) so the
    same target loaded in another dtype (float32 / bfloat16 / float16) is recognised too."""
    cfg = target.config
    arrays = _shared_arrays(target)
    h = hashlib.sha256()
    probe = {}
    for name, x in arrays.items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(x.astype(jnp.bfloat16)).tobytes())
        rows = np.linspace(0, x.shape[0] - 1, 8).round().astype(int)
        probe[name] = np.round(x[rows, :64].astype(np.float32), 6).tolist()
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "sha256_bf16": h.hexdigest(),
        "probe": probe,
        "name": target.name,
    }


def _same_target(stored: dict, target: Model) -> str | None:
    """None when ``target`` is the one ``stored`` describes, else what differs."""
    cfg = target.config
    if stored.get("vocab_size") != cfg.vocab_size:
        return f"vocabulary {stored.get('vocab_size')} vs this target's {cfg.vocab_size}"
    if stored.get("hidden_size") != cfg.hidden_size:
        return f"hidden size {stored.get('hidden_size')} vs this target's {cfg.hidden_size}"
    if bool(stored.get("tie_word_embeddings")) != cfg.tie_word_embeddings:
        return "tied vs untied embeddings"
    now = fingerprint(target)
    if now["sha256_bf16"] == stored.get("sha256_bf16"):
        return None
    for name, rows in (stored.get("probe") or {}).items():
        mine = np.asarray(now["probe"].get(name, []), np.float32)
        theirs = np.asarray(rows, np.float32)
        if mine.shape != theirs.shape:
            return f"its {name} differs"
        scale = float(np.abs(theirs).max()) or 1.0
        # another dtype of the same weights differs by rounding (bf16: ~0.4% relative)
        if not np.allclose(mine, theirs, rtol=1e-2, atol=1e-3 * scale):
            return f"its {name} differs (embedding fingerprint mismatch)"
    if not stored.get("probe"):
        return "the embedding fingerprint differs"
    return None


# ------------------------------------------------------------------------------ draft model


def draft_config(target_cfg: ModelConfig, layers: int, intermediate: int) -> ModelConfig:
    return dataclasses.replace(target_cfg, num_layers=layers, intermediate_size=intermediate)


def _pure(state) -> dict:
    return nnx.to_pure_dict(state)


def _trainable(pure: dict) -> dict:
    return {k: v for k, v in pure.items() if k not in SHARED}


def _assemble(trainable: dict, shared: dict) -> nnx.State:
    return nnx.State({**trainable, **shared})


def _shared_of(target: Model) -> dict:
    pure = _pure(target.params)
    return {k: pure[k] for k in SHARED if k in pure and pure[k] is not None}


def init_draft(target: Model, recipe: Recipe) -> dict:
    """The draft's trainable weights (float32 pure dict): copied target layers or random."""
    from jaxspec.model import new_model

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


def _draft_model(target: Model, cfg: ModelConfig, trainable: dict, name: str) -> Model:
    from jaxspec.model import abstract_model

    dtype = target.dtype
    graphdef, state = abstract_model(cfg, dtype)
    pure = {**jax.tree.map(lambda x: jnp.asarray(x, dtype), trainable), **_shared_of(target)}
    nnx.replace_by_pure_dict(state, pure)
    return Model(cfg, graphdef, state, target.tokenizer, name=name)


def _read_json(path: pathlib.Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable {what} ({e}); distil it again.") from None


def _draft_dir(path: pathlib.Path) -> pathlib.Path:
    if (path / "draft.json").is_file():
        return path
    if (path / "draft" / "draft.json").is_file():  # a distill output folder
        return path / "draft"
    raise CheckpointError(
        f"no distilled draft at {path} (no draft.json); create one with `jaxspec distill "
        f"--out {path}` or jaxspec.distill.distill(target, {str(path)!r})."
    )


def is_draft_checkpoint(path: PathLike) -> bool:
    p = pathlib.Path(path).expanduser()
    return (p / "draft.json").is_file() or (p / "draft" / "draft.json").is_file()


def load_draft(path: PathLike, target: Model) -> Model:
    """Load a distilled draft for ``target``: its own layers from ``path`` (a draft folder or a
    distill output folder), the shared embedding / LM head from ``target``, in the target's dtype
    and with its tokenizer. Raises ``DraftError`` when the draft was distilled for another
    target, ``CheckpointError`` when the files are missing or corrupt."""
    import orbax.checkpoint as ocp

    from jaxspec.convert import _int_keys, _str_keys
    from jaxspec.model import abstract_model

    if not isinstance(target, Model):
        raise OptionError(
            f"load_draft needs the target jaxspec.Model, got {type(target).__name__}."
        )
    d = _draft_dir(pathlib.Path(path).expanduser().absolute())
    meta = _read_json(d / "draft.json", "draft description")
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{d / 'draft.json'} has format {meta.get('format')!r}, not {FORMAT!r}; distil the "
            "draft again with this jaxspec."
        )
    why = _same_target(meta.get("target", {}), target)
    if why is not None:
        raise DraftError(
            f"the draft at {d} was distilled for another target "
            f"({meta.get('target', {}).get('name') or 'unnamed'}: {why}); load it with the "
            "target it was distilled for, or distil a draft for this one with `jaxspec distill`."
        )
    try:
        cfg = ModelConfig.from_json(json.dumps(meta["config"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d / 'draft.json'} has no valid config ({e}).") from None
    dtype = target.dtype
    _, abstract = abstract_model(cfg, dtype)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=dev),
        _trainable(_pure(abstract)),
    )
    if not (d / "params").is_dir():
        raise CheckpointError(f"{d} has no params/ folder; the draft is incomplete.")
    try:
        with ocp.StandardCheckpointer() as ck:
            restored = _int_keys(ck.restore(d / "params", _str_keys(want)))
    except Exception as e:  # Orbax / tensorstore raise many kinds
        raise CheckpointError(
            f"could not restore the draft weights in {d / 'params'} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); the draft is corrupt or "
            "incomplete: distil it again."
        ) from None
    name = f"draft[{cfg.num_layers}L]({meta.get('target', {}).get('name') or target.name})"
    return _draft_model(target, cfg, restored, name)


def shipped_draft(target: Model) -> Model | None:
    """The draft shipped in ``checkpoints/drafts/`` for ``target`` (SmolLM2-135M-Instruct), or
    None when it is absent or belongs to another target."""
    if not is_draft_checkpoint(SHIPPED):
        return None
    try:
        return load_draft(SHIPPED, target)
    except (DraftError, CheckpointError):
        return None


# ------------------------------------------------------------------------------ data


def _sources(spec: DataSpec) -> list[tuple[str, str, bool]]:
    """(name as given, dataset name, chat template?) per source."""
    from jaxspec import datasets

    is_chat = getattr(datasets, "chat_template", lambda n: n == "chat")
    out = []
    for item in spec.data:
        name, _, mode = item.partition("@")
        if mode not in ("", "chat", "raw"):
            raise OptionError(f"data source {item!r}: the suffix must be @chat or @raw.")
        out.append((item, name, is_chat(name) if not mode else mode == "chat"))
    return out


def _prompt_rows(target: Model, spec: DataSpec, prompts) -> tuple[list[list[int]], dict]:
    """Token ids of every training prompt, and a description of where they came from."""
    from jaxspec import datasets
    from jaxspec.prompts import encode_prompts

    if prompts is not None:
        ids = encode_prompts(list(prompts), target.tokenizer, target.config)
        return ids, {"given": {"prompts": len(ids), "held_out": 0}}
    if target.tokenizer is None:
        raise OptionError(
            "the target has no tokenizer, so distill cannot encode dataset prompts; pass "
            "prompts= as lists of token ids."
        )
    rows, info = [], {}
    for item, name, chat in _sources(spec):
        texts, source = datasets.load(name)
        skip = HOLDOUT.get(name, 0)
        kept = texts[skip:]
        if not kept:
            raise OptionError(
                f"data source {item!r} has {len(texts)} prompts, all held out (the first {skip} "
                "are benchmark prompts); add another source."
            )
        ids = encode_prompts(kept, target.tokenizer, target.config, chat=chat)
        rows += ids
        info[item] = {"source": source, "prompts": len(ids), "held_out": skip, "chat": chat}
    return rows, info


def _width(n: int) -> int:
    """The padded prompt width ``pad_prompts`` would pick: the engines' prefill runs over
    ``width // PREFILL_CHUNK`` chunks, so past one chunk the width is a multiple of it."""
    from jaxspec.engines.common import PREFILL_CHUNK

    m = 16 if n <= PREFILL_CHUNK else PREFILL_CHUNK
    return -(-n // m) * m


def _decode_batch(target: Model, rows: list[list[int]], width: int, spec: DataSpec, temp, seed):
    """One batch through the target's own autoregressive engine (the loop ``generate`` runs),
    padded to a fixed width so every batch reuses one compilation."""
    from jaxspec.engines import autoregressive
    from jaxspec.engines.common import trim
    from jaxspec.sampling import Sampling

    b = spec.gen_batch
    real = len(rows)
    rows = rows + [rows[-1]] * (b - real)
    ids = np.zeros((b, width), np.int32)
    lens = np.array([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    out, count, stats = autoregressive.run(
        target,
        None,
        jnp.asarray(ids),
        jnp.asarray(lens),
        max_new=spec.max_new,
        sampling=Sampling(float(temp), 1.0, 0),
        eos=tuple(target.config.eos_token_ids),
        seed=int(seed),
        prompts=None,
    )
    return trim(np.asarray(out), np.asarray(count))[:real], stats


def generate_data(
    target: Model,
    out_dir: pathlib.Path,
    spec: DataSpec,
    *,
    prompts=None,
    deadline: float | None = None,
    progress: bool = True,
) -> dict:
    """The target writes the training documents; saved atomically to ``out_dir``."""
    from tqdm.auto import tqdm

    ids, info = _prompt_rows(target, spec, prompts)
    # a prompt and its continuation fit the context: longer prompts keep their last tokens
    cap = min(spec.max_prompt_tokens, target.config.max_position_embeddings - spec.max_new)
    ids = [p[-cap:] for p in ids]
    width = _width(max(len(p) for p in ids))
    # pass 0: greedy; passes 1..samples: temperature. Ordered by pass, so a budget cut keeps
    # whole passes over every source.
    jobs = [(0, i) for i in range(len(ids))]
    jobs += [(s, i) for s in range(1, spec.samples + 1) for i in range(len(ids))]
    docs: list[np.ndarray] = []
    new_tokens = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(jobs), desc="target writes data", unit="doc", disable=not progress)
    stopped = False
    with bar:
        k = 0
        while k < len(jobs):
            if deadline is not None and time.perf_counter() > deadline and docs:
                stopped = True
                break
            greedy = jobs[k][0] == 0
            chunk = []
            while k < len(jobs) and len(chunk) < spec.gen_batch and (jobs[k][0] == 0) == greedy:
                chunk.append(jobs[k])
                k += 1
            rows = [ids[i] for _, i in chunk]
            seed = spec.seed * 1_000_003 + k
            new, _ = _decode_batch(
                target, rows, width, spec, 0.0 if greedy else spec.temperature, seed
            )
            for r, t in zip(rows, new, strict=True):
                docs.append(np.asarray(r + t, np.int32))
                new_tokens += len(t)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    stream = np.concatenate(docs)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    meta = {
        "spec": _spec_json(spec),
        "sources": info,
        "documents": len(docs),
        "planned_documents": len(jobs),
        "stopped_by_budget": stopped,
        "tokens": int(stream.size),
        "generated_tokens": int(new_tokens),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    tmp = _fresh_dir(out_dir)
    try:
        np.save(tmp / "tokens.npy", stream)
        np.save(tmp / "offsets.npy", offsets)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _spec_json(spec: DataSpec) -> dict:
    d = dataclasses.asdict(spec)
    d["data"] = list(spec.data)
    return d


def _load_data(data_dir: pathlib.Path) -> tuple[np.ndarray, dict]:
    meta = _read_json(data_dir / "meta.json", "data description")
    try:
        stream = np.load(data_dir / "tokens.npy")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{data_dir / 'tokens.npy'} is unreadable ({e}).") from None
    return stream, meta


# ------------------------------------------------------------------------------ training


@contextlib.contextmanager
def _reference_attention():
    """Trace with the pure-jnp attention: it has a gradient (the Pallas kernel does not)."""
    from jaxspec import model as model_mod

    old = model_mod.ATTENTION_IMPL
    model_mod.ATTENTION_IMPL = "reference"
    try:
        yield
    finally:
        model_mod.ATTENTION_IMPL = old


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


@functools.partial(
    jax.jit,
    static_argnames=("tgraph", "tcfg", "dgraph", "dcfg", "recipe"),
    donate_argnums=(0, 1),
)
def train_step(
    train, opt_state, shared, tparams, tokens, step, total, *, tgraph, tcfg, dgraph, dcfg, recipe
):
    """One optimizer step on ``tokens`` [B, T]: teacher forward, draft forward and backward."""
    import optax

    teacher = jax.lax.stop_gradient(full_logits(tgraph, tcfg, tparams, tokens))
    dtype = jax.tree.leaves(tparams)[0].dtype

    def loss_fn(w):
        params = _assemble(jax.tree.map(lambda x: x.astype(dtype), w), shared)
        loss, kl, ce, agree = losses(
            teacher, full_logits(dgraph, dcfg, params, tokens), recipe.ce_weight
        )
        return loss.mean(), {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean()}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
    clip_state, adam_state = opt_state
    lr = lr_at(step, total, recipe)
    adam_state = adam_state._replace(hyperparams={**adam_state.hyperparams, "learning_rate": lr})
    updates, opt_state = _optimizer(recipe).update(grads, (clip_state, adam_state), train)
    train = optax.apply_updates(train, updates)
    return train, opt_state, {"loss": loss, "lr": lr, **aux}


def _windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    n = stream.size // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)


def _batch(windows: np.ndarray, position: int, batch: int, seed: int) -> np.ndarray:
    """Windows ``position .. position + batch`` of the epoch-wise shuffled order."""
    n = windows.shape[0]
    idx = []
    for g in range(position, position + batch):
        epoch, j = divmod(g, n)
        idx.append(_perm(n, seed, epoch)[j])
    return windows[np.asarray(idx)]


@functools.lru_cache(maxsize=8)
def _perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclasses.dataclass
class DistillResult:
    path: pathlib.Path  # the draft folder (load_draft takes it)
    steps: int  # optimizer steps done in total
    total_steps: int
    history: list[dict]  # per step of this call: step, loss, kl, ce, agree, lr
    data: dict  # the data description
    stopped: str | None  # "budget" / "until_step" when the run stopped before total_steps


def _fresh_dir(dst: pathlib.Path) -> pathlib.Path:
    from jaxspec.convert import _fresh_dir as fresh

    dst.parent.mkdir(parents=True, exist_ok=True)
    return fresh(dst, "tmp")


def _replace(tmp: pathlib.Path, dst: pathlib.Path) -> None:
    from jaxspec.convert import _move_into_place

    _move_into_place(tmp, dst)


def _checkpoint_manager(path: pathlib.Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        path.absolute(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False
        ),
    )


def _state_tree(train, opt_state, step, position, total) -> dict:
    from jaxspec.convert import _str_keys

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
    from jaxspec.convert import _np_dtype

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
    from jaxspec.model import abstract_model

    dcfg = draft_config(target.config, recipe.layers, recipe.intermediate)
    dgraph = abstract_model(dcfg, target.dtype)[0]
    shared = _shared_of(target)
    opt = _optimizer(Optim.of(recipe))
    mngr = _checkpoint_manager(out / "train")
    latest = mngr.latest_step() if resume else None
    if latest is not None:
        import orbax.checkpoint as ocp

        from jaxspec.convert import _int_keys

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
    static = dict(
        tgraph=target.graphdef,
        tcfg=target.config,
        dgraph=dgraph,
        dcfg=dcfg,
        recipe=Optim.of(recipe),
    )
    # the step count is fixed while the learning rate does not depend on it yet (warmup), from
    # the median step time over the whole warmup: on the H200 the first steps after the compile
    # ran several times slower than the steady 16 steps/s, and 5 of them fixed 128 steps where
    # the budget had room for over a thousand
    measure = max(3, recipe.warmup)
    reserve = 5.0  # seconds kept for the last checkpoint and the draft's write
    ends: list[float] = []  # step end times; the first step compiles and is not measured
    bar = tqdm(total=total, initial=step, desc="distill", unit="step", disable=not progress)
    last_saved = step
    with bar, _reference_attention():
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
                train, opt_state, shared, target.params, tokens, step, total, **static
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
    from jaxspec.model import abstract_model

    _, st = abstract_model(cfg, jnp.float32)
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), _trainable(_pure(st)))


def _save_args(train, opt_state, step, position, total):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(_state_tree(train, opt_state, step, position, total))


def _summary(rows: list[dict]) -> dict:
    if not rows:
        return {}
    return {k: round(float(np.mean([r[k] for r in rows])), 5) for k in ("loss", "kl", "agree")}


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_draft(dst, cfg, train, store_dtype, fp, *, training) -> pathlib.Path:
    """``draft.json`` + ``params/`` (only the draft's own weights), atomically."""
    import orbax.checkpoint as ocp

    from jaxspec.bench import metadata
    from jaxspec.convert import _str_keys

    weights = jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(store_dtype), train)
    n_params = int(sum(x.size for x in jax.tree.leaves(weights)))
    meta = {
        "format": FORMAT,
        "config": json.loads(cfg.to_json()),
        "dtype": np.dtype(store_dtype).name,
        "parameters": n_params,
        "bytes": int(sum(x.nbytes for x in jax.tree.leaves(weights))),
        "shared_from_target": [k for k in SHARED if k != "lm_head" or not cfg.tie_word_embeddings],
        "target": fp,
        "training": {**training, **{k: v for k, v in metadata().items() if k != "command"}},
    }
    tmp = _fresh_dir(dst)
    try:
        with ocp.StandardCheckpointer() as ck:
            ck.save(tmp / "params", _str_keys(weights))
            ck.wait_until_finished()
        (tmp / "draft.json").write_text(json.dumps(meta, indent=2))
        _replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
