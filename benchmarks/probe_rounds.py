"""Where a speculative round's GPU time goes: chains against trees with the same draft, through
``generate()`` at batch 1, the kernels of each round from a profiler trace.

    python benchmarks/probe_rounds.py --random [--only chain_draft,tree_draft] [--draft-vocab N]
        [--out F.json]
    python benchmarks/probe_rounds.py --draft DIR [--out F.json]   # the real SmolLM2 (GGUF)

Rows: autoregressive; chain and tree with prompt lookup over the same 8 tokens (chain gamma 8,
a tree of depth 8, width 1: the same tokens a verify, so what differs is the tree's own work);
chain (gamma 4) and the default tree with a 2-layer draft. Each row: ``generate()`` of 128
tokens after a 1K context, median of ``--repeats`` calls after a warm-up (``engine_ms``, the
engine's own wall), its rounds (new tokens over the acceptance length) and, from a profiler trace
of one more call, kernels and GPU busy time per round and the kernels that take it (names with
their numbers stripped: ``[name, calls, us a round, calls a round]``) and, by the source line
each kernel's root op was traced at (``by_source``), where a round's GPU time goes in the code.

``--random``: random bf16 weights of the SmolLM2-135M shape and a random 2-layer draft of the
shipped draft's shape (no GGUF: one GPU call). What a round costs depends on its kernels, not on
the weights; acceptance does not carry over (a random draft accepts about nothing), so only the
rounds' costs compare. Without it, the real model and the draft folder ``--draft``, plus trees
of other shapes (their acceptance is real there).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import context_ids, metadata, random_target, write  # noqa: E402
from benchmarks.shapes import SMOLLM2_135M  # noqa: E402
from benchmarks.trace_gaps import (  # noqa: E402
    _stats,
    busy_intervals,
    device_events,
    gpu_planes,
    stream_events,
)
from jaxspec.api import generate  # noqa: E402
from jaxspec.engines import programs  # noqa: E402
from jaxspec.model.vocab_head import with_vocab  # noqa: E402

SHAPES = (  # the real model's extra trees: (name, options)
    ("tree_d4w2b2bs6", {"depth": 4, "width": 2, "branch": 2, "bs": 6}),
    ("tree_d4w4b2bs8", {"depth": 4, "width": 4, "branch": 2, "bs": 8}),
    ("tree_d4w1b1bs4", {"depth": 4, "width": 1, "branch": 1, "bs": 4}),
    ("tree_d3w4b4bs8", {"depth": 3, "width": 4, "branch": 4, "bs": 8}),
)


def kernel_name(name: str) -> str:
    """A kernel's name without XLA's numbering (``loop_add_fusion_29`` -> ``loop_add_fusion``)."""
    return re.sub(r"[._]\d+", "", name)[:60]


def _table(text: str, name: str) -> dict[int, str]:
    """One of the id tables an optimized HLO text ends with (``FileNames``, ``StackFrames``...)."""
    at = text.find("\n" + name + "\n")
    rows = text[at + 1 :].split("\n\n")[0].splitlines()[1:] if at >= 0 else []
    return {int(r.split(" ", 1)[0]): r.split(" ", 1)[1] for r in rows}


def _fields(row: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in row.strip("{}").split())


def _short(path: str) -> str:
    return re.sub(r".*/(jaxspec|pallas_kernels)/", r"\1/", path)


def _where(frame: int, frames: dict, locs: dict) -> str | None:
    """``hlo_sources``' label of a stack frame: its innermost own frame and algorithm line."""
    mine, algo, seen = None, None, set()
    while frame in frames and frame not in seen and algo is None:
        seen.add(frame)
        path, line = locs.get(int(frames[frame]["file_location_id"]), ("?", "?"))
        here = f"{_short(path)}:{line}"
        if mine is None and here.startswith(("jaxspec/", "pallas_kernels/")):
            mine = here
        if here.startswith(("jaxspec/engines/", "jaxspec/spec/")):
            algo = here
        frame = int(frames[frame]["parent_frame_id"]) - 1
    if mine is None:
        return None
    return mine if algo in (None, mine) else f"{mine} < {algo}"


def hlo_sources(texts) -> dict[tuple[str, str], str]:
    """``(module, instruction) -> where`` (and ``instruction -> where``, the first module's),
    from optimized HLO texts: the innermost ``jaxspec`` or
    ``pallas_kernels`` frame of the stack each kernel's root op was traced under, and the
    innermost one in ``jaxspec/engines`` or ``jaxspec/spec`` below it (the algorithm's line),
    e.g. ``jaxspec/model/layers.py:65 < jaxspec/engines/tree.py:156``; instructions named as a
    trace names them (dots and dashes as underscores). The text's ``stack_frame_id`` refers to
    its ``StackFrames`` table, whose ``parent_frame_id`` is one past the parent's id."""
    out = {}
    for text in texts:
        head = re.match(r"HloModule (\S+?),", text)
        module = head.group(1) if head else ""
        files = {k: v.strip('"') for k, v in _table(text, "FileNames").items()}
        locs = {}
        for k, v in _table(text, "FileLocations").items():
            f = _fields(v)
            locs[k] = (files.get(int(f["file_name_id"]), "?"), f["line"])
        frames = {k: _fields(v) for k, v in _table(text, "StackFrames").items()}

        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?stack_frame_id=(\d+)", line)
            if m:
                w = _where(int(m.group(2)), frames, locs)
                if w is not None:
                    name = re.sub(r"[.\-]", "_", m.group(1))
                    out[module, name] = w
                    out.setdefault(name, w)  # by name alone: a trace's module may differ
    return out


def kernel_ops(folder: str) -> tuple[list[tuple[int, str, str, str]], dict]:
    """Each kernel of the newest trace under ``folder``: (ns, name, its HLO module, its HLO op),
    and the stats the first kernel event carries (what a trace names them: for diagnosis)."""
    out, sample = [], {}
    for ev in (ev for plane in gpu_planes(folder) for ev in stream_events(plane)):
        stats = {str(k): v for k, v in _stats(ev)}
        if not sample and "fusion" in ev.name:
            sample = {"name": ev.name, **{k: str(v)[:120] for k, v in stats.items()}}
        module = str(stats.get("hlo_module", ""))
        op = str(stats.get("hlo_op", ev.name))
        out.append((ev.duration_ns, ev.name, module, re.sub(r"[.\-]", "_", op)))
    return out, sample


def source_of(sources: dict, module: str, op: str, name: str) -> str | None:
    """``hlo_sources``' label of a traced kernel: by its module and op, else by its op or its
    kernel name in any of the row's modules (a fusion's kernel is named after it)."""
    for key in ((module, op), op, re.sub(r"[.\-]", "_", name)):
        if key in sources:
            return sources[key]
    return None


def traced(model, ids, new, rounds, sources, **kw) -> dict:
    """Kernels and GPU busy time per round of one ``generate`` call, from a profiler trace; with
    ``sources`` (``hlo_sources`` of the call's programs) also by the source line of each kernel's
    root op (``[file:line, us a round, kernels a round]``)."""
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        generate(model, [ids], max_new_tokens=new, **kw)
    kernels = [k for dev in device_events(folder).values() for k in dev["kernels"]]
    busy = sum(b - a for a, b in busy_intervals(kernels)) / 1e3  # us
    per = collections.defaultdict(lambda: [0, 0])
    for _, dur, name in kernels:
        per[kernel_name(name)][0] += 1
        per[kernel_name(name)][1] += dur
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:40]
    by_line = collections.defaultdict(lambda: [0, 0])
    ops, sample = kernel_ops(folder)
    for dur, name, module, op in ops:
        where = source_of(sources, module, op, name) or f"{kernel_name(name)} (no source)"
        by_line[where][0] += dur
        by_line[where][1] += 1
    lines = sorted(by_line.items(), key=lambda kv: -kv[1][0])[:60]
    return {
        "kernels_per_round": round(len(kernels) / rounds, 1),
        "busy_us_per_round": round(busy / rounds, 1),
        "top": [[n, c, round(t / 1e3 / rounds, 2), round(c / rounds, 2)] for n, (c, t) in top],
        "by_source": [[w, round(t / 1e3 / rounds, 2), round(c / rounds, 2)] for w, (t, c) in lines],
        "kernel_stats_sample": sample,
    }


def row(model, ids, new, repeats, **kw) -> dict:
    before = set(programs._COMPILED)
    generate(model, [ids], max_new_tokens=new, **kw)
    sources = hlo_sources(  # this row's own programs (a module name repeats across rows)
        exe.as_text() for key, exe in programs._COMPILED.items() if key not in before
    )
    walls, last = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        last = generate(model, [ids], max_new_tokens=new, **kw)
        walls.append((time.perf_counter() - t0, last.stats["wall_s"]))
    acc = last.stats["acceptance_length"]
    rounds = last.stats["new_tokens"] / acc
    engine = statistics.median(e for _, e in walls)
    out = {
        "wall_tok_per_s": round(
            last.stats["new_tokens"] / statistics.median(w for w, _ in walls), 1
        ),
        "acceptance_length": round(acc, 3),
        "rounds": round(rounds, 1),
        "engine_ms_per_round": round(1e3 * engine / rounds, 4),
    }
    if jax.default_backend() == "gpu":
        out.update(traced(model, ids, new, rounds, sources, **kw))
    return out


def models(args):
    if args.random:
        from jaxspec.model.transformer import new_model

        target = random_target(SMOLLM2_135M, dtype=jnp.bfloat16)
        shape = dataclasses.replace(SMOLLM2_135M, num_layers=2, intermediate_size=512)
        draft = new_model(shape, seed=1, dtype=jnp.bfloat16)
        if args.draft_vocab:  # a cut head as the shipped drafts have: random ids (lossless)
            rng = np.random.default_rng(2)
            draft = with_vocab(draft, rng.choice(shape.vocab_size, args.draft_vocab, False))
        draft.kernels = target.kernels
        ids = np.random.RandomState(0).randint(4, SMOLLM2_135M.vocab_size, args.ctx - args.new)
        return target, draft, ids.tolist(), "random SmolLM2-135M-shape weights (bfloat16)"
    from jaxspec.io.convert import load
    from jaxspec.io.default_model import default_checkpoint
    from jaxspec.io.draft_checkpoint import load_draft
    from jaxspec.kernels import KernelConfig

    target = load(default_checkpoint(), dtype=jnp.bfloat16)
    target.kernels = KernelConfig.from_env()
    ids = context_ids(target, args.ctx, args.new)
    return target, load_draft(args.draft, target), ids, "SmolLM2-135M-Instruct (bfloat16)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", action="store_true", help="random weights (no GGUF)")
    ap.add_argument("--draft", default=None, help="the draft folder (without --random)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument(
        "--draft-vocab", type=int, default=0, help="with --random: cut the draft's head to N ids"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.random and not args.draft:
        ap.error("give --draft DIR, or --random")
    target, draft, ids, what = models(args)
    todo = [
        ("autoregressive", {}),
        ("chain_ngram", {"method": "chain", "draft": "ngram", "gamma": 8}),
        (
            "tree_ngram",
            {"method": "tree", "draft": "ngram", "depth": 8, "width": 1, "branch": 1, "bs": 8},
        ),  # fmt: skip
        ("chain_draft", {"method": "chain", "draft": draft, "gamma": 4}),
        ("tree_draft", {"method": "tree", "draft": draft}),
    ]
    if not args.random:
        todo += [(n, {"method": "tree", "draft": draft, **o}) for n, o in SHAPES]
    only = set(args.only.split(",")) - {""}
    payload = {**metadata(), "model": what, "context": args.ctx, "new_tokens": args.new,
               "rows": {}}  # fmt: skip
    for name, kw in todo:
        if only and name not in only:
            continue
        r = payload["rows"][name] = row(target, ids, args.new, args.repeats, **kw)
        print(name, json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
        write("spec_rounds.json", payload, args.out)


if __name__ == "__main__":
    main()
