"""A distill run that goes on from a finished draft (``Recipe.init_from``, ``distill
--init-from``): the draft's trainable weights, grown deeper or widened to fused reads where the
recipe asks for more, each added part starting so that the result computes exactly what the
finished draft did."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxspec.errors import OptionError
from jaxspec.io.draft_checkpoint import _draft_dir, _pure, _read_json, _trainable, load_draft
from jaxspec.model.feature_head import EAGLE1_READS, FeatureModel, widened
from jaxspec.model.transformer import Model
from jaxspec.train.feature import reads_of
from jaxspec.train.recipe import Recipe


def weights_from(target: Model, recipe: Recipe, init: Callable) -> dict:
    """The trainable weights (float32) of the finished draft ``recipe.init_from``, which must be
    of the recipe's kind and MLP width, distilled for ``target``, with at most the recipe's
    layers: a run that goes on from it with another recipe (a training-time test, more data, a
    deeper draft, fused reads) and a fresh optimizer and schedule. A shallower draft is grown
    (``grown``), an EAGLE-1 head given the recipe's fused reads widened
    (``feature_head.widened``); ``init(target, recipe)`` gives the random weights of the
    recipe's draft whose added parts they take."""
    draft = load_draft(recipe.init_from, target, vocab=None)  # the weights, the whole head
    kind = "feature" if isinstance(draft, FeatureModel) else "model"
    cfg = draft.config
    if (kind, cfg.intermediate_size) != (recipe.kind, recipe.intermediate) or (
        cfg.num_layers > recipe.layers
    ):
        raise OptionError(
            f"init_from={recipe.init_from!r} is a {kind} draft of {cfg.num_layers} layers and "
            f"MLP width {cfg.intermediate_size}; this run trains a {recipe.kind} draft of "
            f"{recipe.layers} and {recipe.intermediate}. Pass the same --kind and "
            "--intermediate, and --layers no fewer than its."
        )
    own = _trainable(_pure(draft.params))
    if kind == "feature" and draft.reads != reads_of(target, recipe):
        if draft.reads != EAGLE1_READS:
            raise OptionError(
                f"init_from={recipe.init_from!r} reads the target's states {draft.reads} and "
                f"this run's head {reads_of(target, recipe)}; a head is widened from an EAGLE-1 "
                "one (reads 'final') only. Pass its --reads."
            )
        own = widened(own, init(target, recipe), reads_of(target, recipe))
    if cfg.num_layers < recipe.layers:
        own = grown(own, init(target, recipe))
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), own)


def training_of(path: str) -> dict | None:
    """The training record of the finished draft at ``path`` (``draft.json``'s ``training``,
    its own earlier stages nested under ``init_from_training``): read when a run starts from
    it, so the run's draft keeps its whole history even if the folder is replaced later."""
    folder = _draft_dir(pathlib.Path(path).expanduser())
    return _read_json(folder / "draft.json", "draft description").get("training")


def grown(own: dict, fresh: dict) -> dict:
    """A draft's weights ``own`` deepened to the layer count of ``fresh`` (a random draft of the
    wanted shape): its own layers first, then ``fresh``'s later layers with their output
    projections (o_proj, down) zero. A decoder layer adds those projections to its residual
    stream and nothing else, so each added layer starts as the identity and the grown draft
    computes exactly what ``own`` did (progressive stacking); training then opens the new
    layers through those zero projections, whose gradients are not zero."""
    layers = dict(own["layers"])
    for i in range(len(layers), len(fresh["layers"])):
        layer = jax.tree.map(lambda x: x, fresh["layers"][i])  # a copy of the nesting
        for block, proj in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            layer[block][proj]["kernel"] = jnp.zeros_like(layer[block][proj]["kernel"])
        layers[i] = layer
    return {**own, "layers": layers}
