"""Shared bits of the benchmark scripts: run metadata, the models and prompts they run, engine
calls at a fixed shape, JSON output.

Models come with the kernels the ``JAXSPEC_*`` variables set (``KernelConfig.from_env``: unset
ones are the backend's defaults), so a runner varies a kernel by its environment and the script
records ``net.kernels.describe()`` beside its figures.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def metadata() -> dict:
    from jaxspec.provenance import metadata as run_metadata

    return run_metadata()


def device_tag() -> str:
    """A results file's section name for this machine: "cpu", "h100", "h200", else the device
    kind (lower case, dashes)."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu"
    kind = dev.device_kind.lower()
    for gpu in ("h200", "h100"):
        if gpu in kind:
            return gpu
    return kind.replace(" ", "-")


def write(name: str, payload: dict, out: str | None = None) -> pathlib.Path:
    path = pathlib.Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def log(t0: float, msg: str) -> None:
    """A progress line stamped with the seconds since ``t0``."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (a command-line option)."""
    return [int(x) for x in text.split(",") if x.strip()]


def add_vocab_args(ap, rows: str) -> None:
    """``--draft-vocab`` (the drafts' heads: ``load_draft``'s ``vocab``, jaxspec.model.vocab_head)
    and ``--compare-vocab`` (``rows`` again, in the same run, with another head)."""
    from jaxspec.cli.parser import draft_vocab

    for flag, help_ in (
        ("--draft-vocab", "the drafts' heads: load_draft's vocab (jaxspec.model.vocab_head)"),
        ("--compare-vocab", f"also {rows} with this head"),
    ):
        ap.add_argument(flag, type=draft_vocab, default="default", metavar="N|default|full",
                        help=help_)  # fmt: skip


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval prompts (OpenAI, MIT licence): see jaxspec.io.datasets."""
    from jaxspec.io.datasets import humaneval

    return humaneval(n)


def context_ids(model, ctx: int, new: int) -> list[int]:
    """Token ids of real text (the first 20 HumanEval prompts concatenated, repeated as needed),
    cut so that the cache holds ``ctx`` tokens after ``new`` more."""
    ids = model.tokenizer.encode("\n".join(humaneval_prompts(20)))
    while len(ids) < ctx:
        ids = ids + ids
    return ids[: ctx - new]


def default_dtype(name: str = "auto"):
    """bf16 on a GPU, float32 elsewhere (where outputs must equal autoregressive ones), unless
    ``name`` says which."""
    if name == "auto":
        name = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return jnp.dtype(name)


def default_target(path=None, dtype=None):
    """The converted SmolLM2-135M-Instruct (or the checkpoint at ``path``) in ``dtype`` (default:
    ``default_dtype()``), running the kernels of the environment."""
    from jaxspec.io.convert import load
    from jaxspec.io.default_model import default_checkpoint
    from jaxspec.kernels import KernelConfig

    model = load(path or default_checkpoint(progress=False), dtype=dtype or default_dtype())
    model.kernels = KernelConfig.from_env()
    return model


def random_target(cfg, *, seed: int = 0, dtype=None):
    """A model of shape ``cfg`` with random weights, running the kernels of the environment."""
    from jaxspec.kernels import KernelConfig
    from jaxspec.model.transformer import new_model

    model = new_model(cfg, seed=seed, dtype=dtype or default_dtype())
    model.kernels = KernelConfig.from_env()
    return model


def padded(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token-id prompts right-padded to ``width``: ids ``[B, width]``, lengths ``[B]``."""
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, np.array([len(p) for p in prompts], np.int32)


def fixed_call(target, ids, lens, method: str, *, draft=None, max_new: int, eos=(), **options):
    """The call ``jaxspec.api.prepare`` would make, greedy, at the padded shape ``ids [B, W]``
    given here (prompts of any length up to W then share one program: one compile) and with
    the stop tokens ``eos`` (none: every row makes ``max_new`` tokens). ``jaxspec.api.run``
    runs it; its ``engine`` and ``prog`` give the units to time."""
    from jaxspec.api import Call
    from jaxspec.engines import ENGINES, base
    from jaxspec.spec.sampling import Sampling

    engine = ENGINES[method]
    opts = engine.Options.parse(method, options)
    req = base.Request(ids.shape[0], ids.shape[1], max_new, Sampling(), tuple(eos))
    prog, weights = engine.program(target, draft, opts, req, None)
    return Call(engine, prog, target, weights, ids, lens, 0, draft)


def initial(call, *, shift: int = 0):
    """The engine's state after its init (the prefill) for ``call``'s inputs, its caches
    ``shift`` tokens further on (``measure.units.initial``)."""
    from jaxspec.measure import units

    dflat = None if call.draft is None else call.draft.flat
    return units.initial(
        call.engine, call.prog, call.target.flat, dflat, call.ids, call.lens, shift=shift
    )


def unit_ms(call, state, name: str, reps: int) -> float:
    """Milliseconds of the engine's unit ``name`` ("draft", "verify") at ``state``'s context."""
    from jaxspec.measure import units

    dflat = None if call.draft is None else call.draft.flat
    unit = call.engine.units(call.prog)[name]
    return units.unit_ms(unit, call.prog, call.target.flat, dflat, state, reps=reps)
