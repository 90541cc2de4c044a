"""Distilled draft checkpoints: the on-disk format, the target fingerprint, ``load_draft``.

A draft folder holds ``draft.json`` (format, kind, config, the target's fingerprint, the training
record), ``params/`` (Orbax): only the draft's own layers, and ``token_counts.npy``: how often
each token occurs in the text the draft was distilled on, from which ``load_draft`` cuts the
draft's LM head to the most frequent tokens (``model.vocab_head``). The target's embedding (and
LM head) are filled in at load time; a draft loaded with another target is a ``DraftError``.
Written by ``jaxspec.train.distill``. Kinds: "model" (a small decoder, loaded as a ``Model``;
folders without a kind are of it) and "feature" (an EAGLE head over the target's states:
EAGLE-1's final state or EAGLE-3's fused layers, loaded as a ``FeatureModel``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, DraftError, OptionError
from jaxspec.io import places
from jaxspec.io.convert import _int_keys, _move_into_place, _save_params, _str_keys
from jaxspec.io.paths import temp_dir, writing_beside
from jaxspec.model.feature_head import (
    EAGLE1_READS,
    abstract_head,
    head_model,
    parse_reads,
    variant,
)
from jaxspec.model.quantized import dequantize_params
from jaxspec.model.transformer import Model, Network, abstract_model
from jaxspec.model.vocab_head import DEFAULT_SIZE, frequent_ids, with_vocab
from jaxspec.provenance import metadata

FORMAT = "jaxspec-draft/1"
SHARED = ("embed_tokens", "lm_head")  # filled from the target, not stored, not trained
SHIPPED = places.shipped_drafts() / "smollm2-135m-instruct-draft"
SHIPPED_FEATURE = places.shipped_drafts() / "smollm2-135m-instruct-feature"  # fused reads
TOKEN_COUNTS = "token_counts.npy"  # int32 [V]: each token's count in the distill data
PathLike = str | os.PathLike


def _shared_arrays(model: Model) -> dict[str, np.ndarray]:
    """The embedding ``[V, D]`` and LM head of ``model`` as float arrays (a quantized target's
    dequantized: the same target, whether it is loaded quantized or not)."""
    pure = dequantize_params(nnx.to_pure_dict(model.params))
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


def _draft_model(target: Model, cfg: ModelConfig, trainable: dict, name: str) -> Model:
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
        f"--out {path}` or jaxspec.train.distill.distill(target, {str(path)!r})."
    )


def is_draft_checkpoint(path: PathLike) -> bool:
    p = pathlib.Path(path).expanduser()
    return (p / "draft.json").is_file() or (p / "draft" / "draft.json").is_file()


def load_draft(path: PathLike, target: Model, *, vocab: int | str | None = "default") -> Network:
    """Load a distilled draft for ``target``: its own layers from ``path`` (a draft folder or a
    distill output folder), the shared embedding / LM head from ``target``, in the target's dtype
    and with its tokenizer: a ``Model``, or a ``FeatureModel`` for a feature draft (the kind is
    in ``draft.json``). ``vocab``: the draft predicts over that many of the tokens most frequent
    in its distill data (``token_counts.npy``); "default": ``vocab_head.DEFAULT_SIZE`` for this
    backend where the folder has the counts, else the whole vocabulary; None: the whole
    vocabulary. Lossless either way (``model.vocab_head``). Raises ``DraftError`` when the draft
    was distilled for another target, ``CheckpointError`` when the files are missing or corrupt."""
    import orbax.checkpoint as ocp

    if not isinstance(target, Model):
        raise OptionError(
            f"load_draft needs the target jaxspec.Model, got {type(target).__name__}."
        )
    if (
        vocab != "default"
        and vocab is not None
        and (isinstance(vocab, bool) or not isinstance(vocab, int))
    ):
        raise OptionError(
            f"vocab={vocab!r}: give a number of tokens, 'default', or None for the whole "
            "vocabulary."
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
    kind = meta.get("kind", "model")
    if kind not in ("model", "feature"):
        raise CheckpointError(
            f"{d / 'draft.json'} is a draft of kind {kind!r}, which this jaxspec does not know; "
            "update jaxspec or distil the draft again."
        )
    dtype = target.dtype
    reads = _reads_of(d, meta, target.config) if kind == "feature" else None
    if kind == "feature":
        _, abstract = abstract_head(cfg, dtype, reads)
    else:
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
    of = meta.get("target", {}).get("name") or target.name
    if kind == "feature":
        name = f"feature-draft[{cfg.num_layers}L]({of})"
        draft = head_model(target, cfg, restored, name, reads)
    else:
        draft = _draft_model(target, cfg, restored, f"draft[{cfg.num_layers}L]({of})")
    return with_vocab(draft, _vocab_ids(d, vocab, cfg))


def _reads_of(d: pathlib.Path, meta: dict, cfg: ModelConfig) -> tuple[int, ...]:
    """A feature draft's ``reads`` from its ``draft.json`` (EAGLE-1's where it names none),
    layers of the target of config ``cfg``."""
    reads = meta.get("reads", list(EAGLE1_READS))
    ok = isinstance(reads, list) and all(type(i) is int for i in reads)
    text = ",".join("final" if i == -1 else str(i) for i in reads) if ok else ""
    try:
        return parse_reads(text, cfg.num_layers)
    except OptionError:
        raise CheckpointError(
            f"{d / 'draft.json'} names reads {reads!r}, not layers of the target's "
            f"{cfg.num_layers} with the final state (-1) among them; the file is damaged or the "
            "draft is another target's: distil the draft again."
        ) from None


def _vocab_ids(d: pathlib.Path, vocab, cfg: ModelConfig) -> np.ndarray | None:
    """The token ids a draft loaded with ``vocab`` predicts over (None: all of them)."""
    if vocab is None:
        return None
    counts = read_token_counts(d, cfg)
    if counts is None:
        if vocab == "default":
            return None
        raise CheckpointError(
            f"{d} has no {TOKEN_COUNTS}, so its head cannot be cut to the {vocab} most frequent "
            "tokens: distil it again with this jaxspec, count its data's tokens with "
            "`python scripts/draft_token_counts.py` (checkpoints/README.md), or load it with "
            "the whole vocabulary (vocab=None, --draft-vocab full)."
        )
    size = DEFAULT_SIZE.get(jax.default_backend()) if vocab == "default" else vocab
    if size is None or size >= cfg.vocab_size:
        return None
    return frequent_ids(counts, size, always=cfg.eos_token_ids)


def read_token_counts(d: pathlib.Path, cfg: ModelConfig) -> np.ndarray | None:
    """The draft folder's token counts ``[V]``, or None when it has none."""
    path = d / TOKEN_COUNTS
    if not path.is_file():
        return None
    try:
        counts = np.load(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); count the tokens again.") from None
    if counts.shape != (cfg.vocab_size,) or not np.issubdtype(counts.dtype, np.integer):
        raise CheckpointError(
            f"{path} holds {counts.dtype} {counts.shape}, not one count for each of the "
            f"{cfg.vocab_size} tokens; count the tokens again."
        )
    return counts


def write_token_counts(path: PathLike, counts: np.ndarray, source: str) -> np.ndarray:
    """Give the finished draft folder ``path`` token ``counts`` (one for each token id of its
    vocabulary; ``source``: what text they count, recorded in ``draft.json``), each file
    replaced atomically."""
    d = _draft_dir(pathlib.Path(path).expanduser().absolute())
    meta = _read_json(d / "draft.json", "draft description")
    vocab = int(meta["config"]["vocab_size"])
    counts = np.asarray(counts)
    if counts.shape != (vocab,) or not np.issubdtype(counts.dtype, np.integer):
        raise OptionError(
            f"token counts must be {vocab} integers, one for each token id, got {counts.dtype} "
            f"{counts.shape}."
        )
    counts = counts.astype(np.int32)
    tmp = d / f".{TOKEN_COUNTS}.tmp-{os.getpid()}.npy"
    np.save(tmp, counts)
    os.replace(tmp, d / TOKEN_COUNTS)
    meta["token_counts"] = {"file": TOKEN_COUNTS, "tokens": int(counts.sum()), "source": source}
    _write_atomic(d / "draft.json", json.dumps(meta, indent=2))
    return counts


def shipped_draft(
    target: Model, *, kind: str = "model", vocab: int | str | None = "default"
) -> Network | None:
    """The draft of ``kind`` ("model": the small draft; "feature": the EAGLE head) shipped in
    ``checkpoints/drafts/`` (``jaxspec/shipped/`` in a wheel) for ``target``
    (SmolLM2-135M-Instruct), or None when it is absent or belongs to another target; ``vocab``
    as ``load_draft``'s."""
    path = SHIPPED_FEATURE if kind == "feature" else SHIPPED
    if not is_draft_checkpoint(path):
        return None
    try:
        return load_draft(path, target, vocab=vocab)
    except (DraftError, CheckpointError):
        return None


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_draft(
    dst, cfg, train, store_dtype, fp, *, training, kind="model", token_counts=None, reads=None
) -> pathlib.Path:
    """``draft.json`` + ``params/`` (only the draft's own weights) + the data's
    ``token_counts`` when given, atomically. ``kind``: "model" (a small decoder) or "feature" (an
    EAGLE head, ``model.feature_head``, over the target states ``reads``: EAGLE-1's if None)."""
    reads = tuple(reads or EAGLE1_READS)
    weights = jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(store_dtype), train)
    n_params = int(sum(x.size for x in jax.tree.leaves(weights)))
    meta = {
        "format": FORMAT,
        "kind": kind,
        **({"variant": variant(reads), "reads": list(reads)} if kind == "feature" else {}),
        "config": json.loads(cfg.to_json()),
        "dtype": np.dtype(store_dtype).name,
        "parameters": n_params,
        "bytes": int(sum(x.nbytes for x in jax.tree.leaves(weights))),
        "shared_from_target": [k for k in SHARED if k != "lm_head" or not cfg.tie_word_embeddings],
        "target": fp,
        "training": {**training, **{k: v for k, v in metadata().items() if k != "command"}},
    }
    if token_counts is not None:
        meta["token_counts"] = {
            "file": TOKEN_COUNTS,
            "tokens": int(np.sum(token_counts)),
            "source": "the distill data (prompts and the target's continuations), each "
            "source's counts scaled to the largest source's total (train.data.source_counts; "
            "so with several sources they sum past the data's tokens)",
        }
    with writing_beside(dst) as (tmp, _):
        _save_params(tmp / "params", weights)
        if token_counts is not None:
            np.save(tmp / TOKEN_COUNTS, np.asarray(token_counts, np.int32))
        (tmp / "draft.json").write_text(json.dumps(meta, indent=2))
        _replace(tmp, dst)
    return dst


def _fresh_dir(dst: pathlib.Path) -> pathlib.Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return temp_dir(dst)


def _replace(tmp: pathlib.Path, dst: pathlib.Path) -> None:
    _move_into_place(tmp, dst)
