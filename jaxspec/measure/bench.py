"""``jaxspec bench``: run methods over a real prompt set and write one JSON with per-prompt and
overall figures, plus the run's device, jax version, commit and command.

Per prompt: new tokens, wall seconds of its batch, ms per token, acceptance length, and its
batch's time split as shares (``time_split``: draft, verify, handoff, prefill, host). Overall per
method: tokens/s (all new tokens over all wall time), acceptance length, ms per token (mean,
p50, p95 over prompts), the speedup over the first method, ``time_split_s`` (compile, excluded
from every figure; run; handoff for swiftspec) and ``time_split``: seconds and shares of the
wall spent in draft, verify, handoff, prefill and host (``jaxspec.measure.time_split``). The engines
run their loop on device, so the split is measured as component timings x counts: after each batch
the engine's own pieces (one draft step, one target verify or decode step, one prefill) are
timed in isolation at the batch's shapes (once per shape, compile excluded), multiplied by the
run's step counts, handoff as the engine measured it, and host is the remainder (loop control,
bookkeeping, commits, dispatch; clamped at 0 with ``host_clamped`` when the parts exceed the
wall). ``time_split=False`` (``--no-time-split``) skips that extra measurement. Compilation is
excluded: each method runs one warm-up batch.

Every method's tokens are compared with the reference (autoregressive when it runs, else the first
method): ``tokens_match`` counts identical prompts, and each prompt says ``matches_reference`` and
``first_diff``. ``peers`` (``hf``, ``hf-assisted``; see ``jaxspec.measure.peers``) add HF
transformers rows on the same weights and prompts, compared with the same reference (reported, never
fatal: bf16 arithmetic may differ; no time split).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

from jaxspec.api import METHODS, generate
from jaxspec.engines import ENGINES
from jaxspec.errors import OptionError
from jaxspec.measure import time_split as ts
from jaxspec.measure.peers import PEERS, run_peer
from jaxspec.prompts import encode_prompts
from jaxspec.provenance import metadata


def _taken(method: str) -> tuple[str, ...]:
    """The options a method's engine takes."""
    return ENGINES[method].Options.names()


def _draft_name(draft) -> str | None:
    """A JSON-able name of the draft: its kind, or the checkpoint's name."""
    if draft is None or isinstance(draft, str):
        return draft
    return getattr(draft, "name", None) or type(draft).__name__


def _method_rows(
    target, method, draft, prompts, ids, *, batch, max_new, options, bar, over, split, reps,
    kernels=None,
):  # fmt: skip
    options = {k: v for k, v in options.items() if k in _taken(method)}
    kw = dict(
        method=method,
        draft=draft if method != "autoregressive" else None,
        max_new_tokens=max_new,
        kernels=kernels,
        **options,
    )
    first = generate(target, ids[:batch], **kw)  # compile (excluded)
    rows, wall, new, accs, handoff, tokens = [], 0.0, 0, [], 0.0, []
    units: dict = {}  # time-split units per run program and shape
    splits, used, counts = [], [], {"runs": 0, "loop_steps": 0, "draft_steps": 0}
    for start in range(0, len(ids), batch):
        if rows and over():
            break
        chunk = ids[start : start + batch]
        r = generate(target, chunk, **kw)
        s = r.stats
        wall += s["wall_s"]
        new += s["new_tokens"]
        accs.append(s["acceptance_length"])
        handoff += s.get("handoff_s", 0.0)
        share = None
        if split:
            key = ts.shape_key(r.call)
            if key not in units:
                units[key] = ts.measure(r.call, reps=reps)
            splits.append(ts.attribute(s, units[key], method))
            used.append(units[key])
            share = ts.fractions(splits[-1])
            counts["runs"] += 1
            counts["loop_steps"] += int(s.get("verify_steps", s["target_steps"] - 1))
            counts["draft_steps"] += int(s.get("draft_steps", 0))
        for i, toks in enumerate(r.tokens):
            tokens.append(list(toks))
            rows.append(
                {
                    "prompt": start + i,
                    "prompt_tokens": len(chunk[i]),
                    "new_tokens": len(toks),
                    "wall_s": round(s["wall_s"], 6),
                    "ms_per_token": round(1e3 * s["wall_s"] / max(len(toks), 1), 4),
                    "acceptance_length": round(s["acceptance_length"], 4),
                    **({"time_split": share} if share is not None else {}),
                }
            )
        if bar is not None:
            bar.update(len(chunk))
    lat = [r["ms_per_token"] for r in rows]
    return {
        "method": method,
        "draft": _draft_name(draft) if method != "autoregressive" else None,
        "options": options,
        "tokens_per_s": round(new / wall, 3) if wall > 0 else None,
        "acceptance_length": round(statistics.mean(accs), 4),
        "ms_per_token": {
            "mean": round(statistics.mean(lat), 4),
            "p50": round(float(np.percentile(lat, 50)), 4),
            "p95": round(float(np.percentile(lat, 95)), 4),
        },
        "time_split_s": {
            "compile": round(first.stats["compile_s"], 3),
            "run": round(wall, 6),
            **({"handoff": round(handoff, 6)} if method == "swiftspec" else {}),
        },
        **({"time_split": ts.summarize(splits, used, counts)} if splits else {}),
        "new_tokens": new,
        **({"truncated": True} if len(rows) < len(ids) else {}),
        "per_prompt": rows,
        "_tokens": tokens,
    }


def compare(tokens: list[int], reference: list[int] | None) -> dict:
    """Whether ``tokens`` equal ``reference``, and the first index where they differ."""
    if reference is None:
        return {}
    n = min(len(tokens), len(reference))
    diff = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if diff is None and len(tokens) != len(reference):
        diff = n
    return {"matches_reference": diff is None, "first_diff": diff}


def _compared(results: list[dict]) -> tuple[list[dict], str | None]:
    """The JSON rows: each run's tokens compared with the reference run's, speedups against
    the first run; the internal token lists dropped. Returns (rows, reference method)."""
    done = [r for r in results if not r.get("skipped")]
    ref = next((r for r in done if r["method"] == "autoregressive"), done[0] if done else None)
    reference = ref["_tokens"] if ref else []
    base = done[0]["tokens_per_s"] if done else None
    out = []
    for r in results:
        row = {k: v for k, v in r.items() if k != "_tokens"}
        if "_tokens" in r:
            per = []
            for p, toks in zip(r["per_prompt"], r["_tokens"], strict=True):
                i = p["prompt"]
                per.append({**p, **compare(toks, reference[i] if i < len(reference) else None)})
            row["per_prompt"] = per
            seen = [p for p in per if "matches_reference" in p]
            row["tokens_match"] = sum(p["matches_reference"] for p in seen)
            row["tokens_compared"] = len(seen)
        if row.get("tokens_per_s") is not None:
            row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 4) if base else None
        out.append(row)
    return out, (ref["method"] if ref else None)


def run(
    target,
    *,
    methods,
    draft,
    prompts,
    source: str,
    dataset: str,
    max_new_tokens: int,
    batch: int,
    options: dict,
    progress: bool = True,
    chat: bool = False,
    peers: tuple[str, ...] | list[str] = (),
    budget_s: float | None = None,
    on_update=None,
    clock=None,
    time_split: bool = True,
    split_reps: int = 3,
    kernels=None,
) -> dict:
    """Run every method, then every peer, over the prompts; returns the JSON-ready result.

    ``budget_s``: past this many seconds no new batch, method or peer starts (the rows say
    ``truncated`` or ``skipped``), so a time limit still leaves results. ``on_update`` is called
    with the result so far after each method and peer (the CLI writes the JSON each time).
    ``clock``: seconds, default ``time.monotonic`` (tests pass their own). ``time_split``:
    measure each method's draft / verify / handoff / prefill / host split (``split_reps``
    timed calls per component and run shape; costs extra time outside every wall).
    """
    _check(methods, peers, batch, budget_s, options)
    clock = clock or time.monotonic
    deadline = None if budget_s is None else clock() + budget_s

    def over() -> bool:
        return deadline is not None and clock() > deadline

    ids = encode_prompts(list(prompts), target.tokenizer, target.config, chat=chat)
    results: list[dict] = []
    head = {
        **metadata(), "model": target.name or "", "dataset": dataset, "source": source,
        "chat_template": chat, "prompts": len(ids), "max_new_tokens": max_new_tokens,
        "batch": batch, "time_split": time_split,
        "kernels": target.net(kernels).kernels.describe(),
        **({"budget_s": budget_s} if budget_s is not None else {}),
    }  # fmt: skip

    def result() -> dict:
        rows, reference = _compared(results)
        return {**head, "reference": reference, "methods": rows}

    peer_cache: dict = {}
    for name, is_peer in [(m, False) for m in methods] + [(p, True) for p in peers]:
        if over():
            results.append(_skipped(name, draft, is_peer))
            continue
        bar = tqdm(
            total=len(ids), desc=f"bench {name}", unit="prompt", disable=not progress,
            file=sys.stderr,
        )  # fmt: skip
        if is_peer:
            row = run_peer(
                name, target, draft, _draft_name(draft), ids, max_new=max_new_tokens,
                gamma=int(options.get("gamma", 4)), ngram=int(options.get("ngram", 3)),
                cache=peer_cache, bar=bar, over=over,
            )  # fmt: skip
        else:
            row = _method_rows(
                target, name, draft, prompts, ids, batch=batch, max_new=max_new_tokens,
                options=options, bar=bar, over=over, split=time_split, reps=split_reps,
                kernels=kernels,
            )  # fmt: skip
        bar.close()
        results.append(row)
        if on_update is not None:
            on_update(result())
    peer_cache.clear()
    return result()


def _skipped(name: str, draft, is_peer: bool) -> dict:
    """The row of a method or peer that the time budget left out."""
    dname = _draft_name(draft) if name not in ("autoregressive", "hf") else None
    row = {"method": name, "draft": dname, "skipped": "the time budget (--budget-s) was spent"}
    return {**row, "peer": True} if is_peer else row


def _check(methods, peers, batch, budget_s, options) -> None:
    """The bench's arguments, before any work (``OptionError`` naming the bad one)."""
    if not methods:
        raise OptionError(f"give at least one method among {', '.join(METHODS)}.")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise OptionError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}.")
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise OptionError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)}.")
    if batch < 1:
        raise OptionError(f"--batch must be positive, got {batch}.")
    if budget_s is not None and budget_s <= 0:
        raise OptionError(f"--budget-s must be positive, got {budget_s}.")
    unused = sorted(set(options) - {k for m in methods for k in _taken(m)})
    if unused:
        raise OptionError(f"no method among {', '.join(methods)} takes {', '.join(unused)}.")
    for m in methods:  # each method's values checked now, not after the methods before it ran
        ENGINES[m].Options.parse(m, {k: v for k, v in options.items() if k in _taken(m)})


def table(result: dict) -> str:
    """One row per method and peer; the time split as percentages of the wall (``*``: host was
    clamped at 0 in at least one run, whose measured parts exceeded its wall; ``-``: not
    measured); ``same`` counts prompts whose tokens equal the reference's."""
    head = (
        f"{'method':>15} {'draft':>15} {'tok/s':>9} {'accept':>7} {'ms/tok p50':>11} "
        f"{'p95':>8} {'speedup':>8} {split_head()} {'same':>7}"
    )
    lines = [head]
    for r in result["methods"]:
        draft = str(r.get("draft") or "-")[-15:]
        if r.get("skipped"):
            lines.append(f"{r['method']:>15} {draft:>15}   skipped: {r['skipped']}")
            continue
        same = f"{r['tokens_match']}/{r['tokens_compared']}" if "tokens_match" in r else "-"
        lines.append(
            f"{r['method']:>15} {draft:>15} {r['tokens_per_s']:>9.1f} "
            f"{r['acceptance_length']:>7.2f} {r['ms_per_token']['p50']:>11.2f} "
            f"{r['ms_per_token']['p95']:>8.2f} {r['speedup_vs_first']:>7.2f}x "
            f"{split_cells(r.get('time_split'))} {same:>7}"
        )
    return "\n".join(lines)


SPLIT_COLUMNS = (("draft", 6), ("verify", 7), ("handoff", 8), ("prefill", 8), ("host", 6))


def split_head() -> str:
    return " ".join(f"{name + '%':>{w}}" for name, w in SPLIT_COLUMNS)


def split_cells(split: dict | None) -> str:
    """The split's shares as percentages, aligned under ``split_head``."""
    cells = []
    for name, w in SPLIT_COLUMNS:
        if not split:
            cells.append(f"{'-':>{w}}")
            continue
        cell = f"{100 * split['fractions'][name]:.1f}"
        if name == "host" and split.get("host_clamped"):
            cell += "*"
        cells.append(f"{cell:>{w}}")
    return " ".join(cells)
