"""``jaxspec.generate``: one entry point over every decoding method.

The path of a call: the prompts are encoded and padded; the engine (``ENGINES[method]``) parses
its options once; options left open for measuring (MagicDec's gamma, SwiftSpec's split and d)
are chosen by ``measure.tuning``; the engine builds its static program (the models' resolved
kernels, the draft, the shapes) and runs it; the tokens are trimmed at EOS and decoded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jaxspec.engines import ENGINES, base
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.measure import tuning
from jaxspec.model.prefill import pad_prompts
from jaxspec.model.transformer import Model
from jaxspec.prompts import check_context, prompt_arrays
from jaxspec.spec.sampling import Sampling

METHODS = tuple(ENGINES)


@dataclasses.dataclass
class GenerationResult:
    """New tokens per prompt (stopping at EOS, kept, or max_new_tokens), their text when the
    model has a tokenizer, and the run's typed statistics (also readable as a mapping:
    ``stats["wall_s"]``, ``tokens_per_s``, ``acceptance_length``, ...). ``call`` is what ran
    (engine, program, inputs), for measurements that time its pieces (``measure.time_split``)."""

    tokens: list[list[int]]
    text: list[str] | None
    stats: base.Stats
    call: Any = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class Call:
    """One run's engine, static program, weights and padded inputs."""

    engine: base.Engine
    prog: Any
    target: Model
    draft: Any  # the draft's weights (or SwiftSpec's placement), as the engine returned them
    ids: np.ndarray
    lens: np.ndarray
    seed: int
    draft_arg: Any = None  # the draft as the caller gave it
    chosen: dict | None = None  # what measure.tuning chose for open options, and from what
    progress: Any = None  # progress(message) before a wait: a measurement, a compile


def _number(name: str, value, *, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        kind = "an integer" if integer else "a number"
        raise OptionError(f"{name} must be {kind}, got {value!r}.")
    if integer and not float(value).is_integer():
        raise OptionError(f"{name} must be an integer, got {value!r}.")
    if not math.isfinite(float(value)):
        raise OptionError(f"{name} must be finite, got {value!r}.")
    return int(value) if integer else float(value)


def sampling_of(temperature, top_p, top_k) -> Sampling:
    """The sampling settings, checked (``OptionError`` naming the bad one)."""
    return Sampling(
        _number("temperature", temperature),
        _number("top_p", top_p),
        _number("top_k", top_k, integer=True),
    )


def prepare(  # user values are checked here, so their hints stay off the runtime checker
    target,
    prompts,
    *,
    draft=None,
    method="autoregressive",
    max_new_tokens=64,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    seed=0,
    chat=False,
    kernels=None,
    progress=None,
    profile_dir=None,
    streamed=False,
    **method_options,
) -> Call:
    """Everything ``generate`` resolves before running: the engine, its program, the inputs.
    ``progress(message)`` hears of each wait before it starts (a measurement of open options,
    a compile); default: silent. ``profile_dir``: a folder where measurements of open options
    are kept for later processes (``measure.profiles``; default: none). ``streamed``: the call
    will run streamed (``stream``), so a measurement that runs the call's own program (MagicDec's
    alpha) compiles the streamed programs the run then finds."""
    if not isinstance(target, Model):
        raise OptionError(
            f"target must be a jaxspec.Model (from jaxspec.load), got {type(target).__name__}."
        )
    engine = ENGINES.get(method) if isinstance(method, str) else None
    if engine is None:
        raise OptionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int | np.integer)
        or max_new_tokens < 1
    ):
        raise OptionError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
        raise OptionError(f"seed must be an integer in [0, 2**32), got {seed!r}.")
    if kernels is not None and not isinstance(kernels, KernelConfig):
        raise OptionError(f"kernels must be a jaxspec.KernelConfig, got {type(kernels).__name__}.")
    sampling = sampling_of(temperature, top_p, top_k)
    cfg = target.config
    ids = prompt_arrays(prompts, target.tokenizer, cfg, chat=chat)
    check_context([len(p) for p in ids], int(max_new_tokens), cfg)
    padded, lens = pad_prompts(ids, target.net(kernels).kernels)
    req = base.Request(
        padded.shape[0], padded.shape[1], int(max_new_tokens), sampling, tuple(cfg.eos_token_ids)
    )
    if progress is not None and not callable(progress):
        raise OptionError(f"progress must be a function of one message, got {progress!r}.")
    key = _program_key(engine, method_options, target, draft, req, kernels)
    kept = None if key is None else target._cache.get(_PROGRAMS, {}).get(key)
    if kept is not None:  # the same call as before: its options were checked then
        prog, dweights = kept
        return Call(engine, prog, target, dweights, padded, lens, int(seed), draft, None, progress)
    options = engine.Options.parse(method, method_options)
    chosen = None
    if engine.open_choices(options) and jax.process_count() > 1:
        raise OptionError(
            f"method={method!r} leaves {', '.join(engine.open_choices(options))} to be chosen by "
            f"timing, and the {jax.process_count()} processes of this job would time differently "
            "and build different programs; give them (swiftspec: target_devices, draft_devices, "
            "depth; magicdec: gamma and shape)."
        )
    if engine.open_choices(options):
        options, chosen = tuning.tune(
            engine, target, draft, options, padded, lens, req, kernels, progress=progress,
            profile_dir=profile_dir, streamed=bool(streamed),
        )  # fmt: skip
    prog, dweights = engine.program(target, draft, options, req, kernels)
    if key is not None and chosen is None:
        _keep_program(target, key, (prog, dweights))
    return Call(engine, prog, target, dweights, padded, lens, int(seed), draft, chosen, progress)


# A call's static program, kept on its target (``Model._cache``, which drops it with the
# parameters) per call signature, the ``KEPT_PROGRAMS`` most recent: parsing the options and
# building the program again cost 0.1 ms of a warm call hot, 0.2-0.3 ms after a program run
# (benchmarks/notes/host_overhead.md). Calls whose options are measured (tuning) are not kept.
_PROGRAMS = "programs"
KEPT_PROGRAMS = 16


def _program_key(engine, method_options, target: Model, draft, req, kernels):
    """What a call's program depends on besides the prompts' values, or None when a value is
    not hashable (nothing is kept). A draft model counts with its parameters and kernels, an
    option with its type."""
    if isinstance(draft, Model):
        draft = (draft, draft.weights, draft.kernels)
    options = tuple(sorted((k, _typed(v)) for k, v in method_options.items()))
    key = (engine.name, options, req, kernels, target.kernels, draft)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _typed(value):
    """An option's value with its type, nested: 4 and 4.0 (or True and 1) are equal keys, but
    only one of them is a valid option."""
    if isinstance(value, tuple | list):
        return type(value), tuple(_typed(v) for v in value)
    return type(value), value


def _keep_program(target: Model, key, value) -> None:
    kept = target._cache.setdefault(_PROGRAMS, {})
    kept.pop(key, None)
    kept[key] = value
    while len(kept) > KEPT_PROGRAMS:
        del kept[next(iter(kept))]


def run(call: Call) -> GenerationResult:
    """Run a prepared call: tokens trimmed at EOS, text, stats."""
    r = call.engine.run(
        call.prog, call.target, call.draft, call.ids, call.lens, call.seed, progress=call.progress
    )
    return result_of(call, r)


def result_of(call: Call, r: base.Run) -> GenerationResult:
    """The ``GenerationResult`` of a finished run."""
    tokens = trim(r.tokens, r.count)
    stats = r.stats
    stats.method = call.engine.name
    stats.new_tokens = sum(len(t) for t in tokens)
    stats.tokens_per_s = stats.new_tokens / stats.wall_s if stats.wall_s > 0 else float("inf")
    if call.chosen is not None:
        stats.tuning = call.chosen
        for k, v in call.chosen.get("stats", {}).items():
            setattr(stats, k, v)
    tok = call.target.tokenizer
    text = None if tok is None else [tok.decode(t, skip_special_tokens=True) for t in tokens]
    return GenerationResult(tokens, text, stats, call)


def generate(
    target,
    prompts,
    *,
    draft=None,
    method="autoregressive",
    max_new_tokens=64,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    seed=0,
    chat=False,
    kernels=None,
    progress=None,
    profile_dir=None,
    **method_options,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt with ``method``.

    prompts: a string, a list of strings, a flat list of token ids (one prompt, as HF takes
    ``input_ids``), a list of id lists (ragged lengths are fine), or a 1-D / 2-D integer array.
    draft: a ``Model`` (same vocabulary), or "self-streaming", "self-snapkv", "ngram".
    chat: wrap string prompts in the tokenizer's chat template as one user turn.
    kernels: the ``KernelConfig`` of this call (default: the model's own, else the defaults).
    progress: ``progress(message)`` before each wait (measuring open options, compiling).
    profile_dir: a folder keeping the measurements of open options (MagicDec's gamma) for
    later processes on this machine.
    Every speculative method returns exactly the target's greedy tokens at temperature 0 and
    samples from the target's distribution otherwise.
    """
    return run(
        prepare(
            target, prompts, draft=draft, method=method, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
            kernels=kernels, progress=progress, profile_dir=profile_dir, **method_options,
        )
    )  # fmt: skip


def stream(
    target,
    prompts,
    *,
    draft=None,
    method="autoregressive",
    max_new_tokens=64,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    seed=0,
    chat=False,
    kernels=None,
    progress=None,
    profile_dir=None,
    segment_steps=None,
    **method_options,
) -> Stream:
    """``generate``, as the tokens are accepted: iterate the returned ``Stream`` for ``Piece``s
    (each prompt's new tokens and their text), then read ``stream.result``, the
    ``GenerationResult`` ``generate`` would have returned. Same arguments, same engines, the
    same tokens: the engine's on-device loop runs in segments of at most ``segment_steps``
    iterations (default: ``engines.base.STREAM_STEPS`` of this backend), run back to back
    by a worker thread (``engines.base.segments``). SwiftSpec's loops yield once, at
    the end. Joined, a prompt's pieces are exactly its ``result.tokens`` and ``result.text``."""
    call = prepare(
        target, prompts, draft=draft, method=method, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
        kernels=kernels, progress=progress, profile_dir=profile_dir, streamed=True,
        **method_options,
    )  # fmt: skip
    return Stream(call, base.stream_steps(segment_steps))


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one prompt (``index`` into the prompts) gained since its last piece: ``tokens``
    (new ids, possibly none when only held-back text is released) and ``text`` (their text;
    None without a tokenizer)."""

    index: int
    tokens: list[int]
    text: str | None


class Stream:
    """The pieces of a streamed call, in order; ``result`` once they are all read."""

    def __init__(self, call: Call, steps: int):
        self.call = call
        self.result: GenerationResult | None = None
        self._pieces = self._run(steps)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Piece:
        return next(self._pieces)

    def _run(self, steps: int):
        c = self.call
        runs = c.engine.stream(
            c.prog, c.target, c.draft, c.ids, c.lens, c.seed, steps=steps, progress=c.progress
        )
        tok = c.target.tokenizer
        rows = len(c.ids)
        seen = [0] * rows
        texts = [None if tok is None else IncrementalText(tok) for _ in range(rows)]
        while True:
            try:
                tokens, count = next(runs)
            except StopIteration as stop:
                final = stop.value
                break
            for b in range(rows):
                new = tokens[b, seen[b] : int(count[b])].tolist()
                if new:
                    seen[b] += len(new)
                    text = None if tok is None else texts[b].add(tokens[b, : seen[b]].tolist())
                    yield Piece(b, new, text)
        self.result = result_of(c, final)
        for b, t in enumerate(texts):  # the characters held back, now complete (or final)
            rest = None if t is None else t.finish(self.result.text[b])
            if rest:
                yield Piece(b, [], rest)


class IncrementalText:
    """A prompt's text as its tokens arrive: each ``add`` returns the text not yet returned.
    A trailing U+FFFD (a character whose bytes are split across tokens) is held back until the
    rest arrives, and text is returned only while the decoding of the tokens so far extends
    what was returned, so the pieces join to exactly the decoding of all the tokens."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sent = tokenizer, ""

    def add(self, ids: list[int]) -> str:
        return self._extend(self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd"))

    def finish(self, text: str) -> str:
        """What is left of ``text``, the decoding of all the tokens."""
        return self._extend(text)

    def _extend(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""  # held: a later decoding settles it
        new, self.sent = text[len(self.sent) :], text
        return new


def trim(out: np.ndarray, n: np.ndarray) -> list[list[int]]:
    return [row[: int(k)].tolist() for row, k in zip(np.asarray(out), np.asarray(n), strict=True)]


__all__ = [
    "generate", "GenerationResult", "METHODS", "Piece", "prepare", "result_of", "run", "stream",
    "Stream",
]  # fmt: skip
