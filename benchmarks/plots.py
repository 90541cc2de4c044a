"""PNG plots of the benchmark JSONs, under ``benchmarks/plots/``.

    python benchmarks/plots.py              # every plot of every results/*.json
    python benchmarks/plots.py results/bench_cpu.json --out /tmp/plots

Which plots a result gets follows from its JSON alone (``plans``), so ``make_results.py`` can
link them without drawing anything (and without matplotlib, which only drawing needs):

* ``<name>_tokens_per_s.png``: tokens/s by method (and draft), from a ``jaxspec bench`` JSON
  (``methods``) or a spec-core JSON (``results``); HF peers in orange.
* ``<name>_acceptance.png``: histogram of per-prompt acceptance lengths of each speculative
  method (rows of ``per_prompt``).
* ``<name>_speedup.png``: MagicDec-style speedup over autoregressive decoding by batch, one line
  per prefix length and draft, from ``rows`` of ``{batch, prefix, draft, speedup}`` (or
  ``predicted_speedup``); where several rows share a point (several gammas), the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"


@dataclasses.dataclass(frozen=True)
class Plan:
    file: str  # PNG file name under the plots folder
    kind: str  # "tokens_per_s" | "acceptance" | "speedup" | "throughput"
    caption: str
    section: str | None = None  # key of a per-device section (e.g. distill.json's "cpu")


METHOD_KEYS = ("methods", "results")


def method_rows(data: dict) -> list[dict]:
    """Per-method rows of a bench JSON (``methods``) or a spec-core JSON (``results``)."""
    for key in METHOD_KEYS:
        rows = data.get(key)
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            if any("tokens_per_s" in r and "method" in r for r in rows):
                return rows
    return []


def sections(data: dict) -> list[str]:
    """Keys of per-device sections: dict values that hold method rows of their own (a JSON such
    as distill.json keeps one section per device)."""
    return [k for k, v in data.items() if isinstance(v, dict) and method_rows(v)]


def label(row: dict) -> str:
    draft = row.get("draft")
    if draft in (None, "-", "") and row.get("name") not in (None, row["method"]):
        draft = row["name"]
    text = str(row["method"]) + (" (HF)" if row.get("peer") else "")
    if draft not in (None, "-", ""):
        text += f"\n{draft}"
    return text


def acceptance_samples(row: dict) -> list[float]:
    return [
        float(p["acceptance_length"])
        for p in row.get("per_prompt") or []
        if isinstance(p, dict) and p.get("acceptance_length") is not None
    ]


def speculative(row: dict) -> bool:
    """A row whose acceptance lengths say something (not autoregressive, not plain HF)."""
    return row["method"] not in ("autoregressive", "hf") and bool(acceptance_samples(row))


def speedup_key(rows: list[dict]) -> str | None:
    for key in ("speedup", "predicted_speedup"):
        if all(isinstance(r, dict) and {"batch", "prefix", key} <= set(r) for r in rows):
            return key
    return None


def plans(name: str, data: dict, section: str | None = None) -> list[Plan]:
    out = []
    rows = method_rows(data)
    if [r for r in rows if r.get("tokens_per_s")]:
        out.append(Plan(f"{name}_tokens_per_s.png", "tokens_per_s", "tokens/s by method", section))
    if any(speculative(r) for r in rows):
        out.append(
            Plan(
                f"{name}_acceptance.png",
                "acceptance",
                "per-prompt acceptance lengths (tokens per verification)",
                section,
            )
        )
    if section is None and not rows:
        for key in sections(data):
            out += plans(f"{name}_{key}", data[key], key)
    srows = data.get("rows")
    if isinstance(srows, list) and srows and speedup_key(srows):
        out.append(
            Plan(
                f"{name}_speedup.png", "speedup", "speedup over autoregressive by batch and prefix"
            )
        )
        if all("throughput_speedup" in r for r in srows):
            out.append(
                Plan(
                    f"{name}_throughput.png",
                    "throughput",
                    "throughput speedup (MagicDec's measure) by batch and prefix",
                )
            )
    return out


def draw(plan: Plan, data: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    if plan.section is not None:
        data = data[plan.section]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    title = f"{data.get('device', '')} · {plan.caption}".strip(" ·")
    if plan.kind == "tokens_per_s":
        rows = [r for r in method_rows(data) if r.get("tokens_per_s")]
        xs = range(len(rows))
        bars = ax.bar(xs, [r["tokens_per_s"] for r in rows], color="#4c72b0")
        for bar, r in zip(bars, rows, strict=True):
            if r.get("peer"):
                bar.set_facecolor("#dd8452")
            ax.annotate(
                f"{r['tokens_per_s']:.1f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(xs), [label(r) for r in rows], fontsize=8)
        ax.set_ylabel("tokens/s")
    elif plan.kind == "acceptance":
        rows = [r for r in method_rows(data) if speculative(r)]
        samples = [acceptance_samples(r) for r in rows]
        top = max(max(s) for s in samples)
        bins = [1 + 0.25 * i for i in range(int((top - 1) / 0.25) + 2)]
        ax.hist(samples, bins=bins, label=[label(r).replace("\n", " + ") for r in rows])
        ax.set_xlabel("acceptance length (tokens per verification)")
        ax.set_ylabel("prompts")
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    elif plan.kind in ("speedup", "throughput"):
        rows = data["rows"]
        key = speedup_key(rows) if plan.kind == "speedup" else "throughput_speedup"
        best: dict[tuple, dict[int, float]] = {}
        for r in rows:
            line = (r["prefix"], r.get("draft", ""))
            point = best.setdefault(line, {})
            point[r["batch"]] = max(point.get(r["batch"], float("-inf")), float(r[key]))
        batches = sorted({b for points in best.values() for b in points})
        for (prefix, draft), points in sorted(best.items(), key=lambda kv: str(kv[0])):
            bs = sorted(points)
            name = f"prefix {prefix}" + (f", {draft}" if draft else "")
            ax.plot(bs, [points[b] for b in bs], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel(key.replace("_", " "))
        ax.legend(fontsize=7)
    else:
        raise ValueError(plan.kind)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def draw_all(files: list[pathlib.Path], out: pathlib.Path) -> list[pathlib.Path]:
    written = []
    for f in files:
        data = json.loads(f.read_text())
        if not isinstance(data, dict):
            continue
        for plan in plans(f.stem, data):
            draw(plan, data, out / plan.file)
            written.append(out / plan.file)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=pathlib.Path, help="default: results/*.json")
    ap.add_argument("--out", type=pathlib.Path, default=PLOTS)
    args = ap.parse_args(argv)
    files = args.files or sorted(RESULTS.glob("*.json"))
    for path in draw_all(files, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
