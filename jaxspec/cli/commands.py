"""``jaxspec convert``, ``bench``, ``profile`` and ``distill``."""

from __future__ import annotations

import json
import pathlib
import sys

import jax

from jaxspec import provenance
from jaxspec.cli import env
from jaxspec.cli.generate import parse_options
from jaxspec.cli.parser import DISTILL_OPTIONS
from jaxspec.engines import tree
from jaxspec.errors import DeviceError, OptionError
from jaxspec.host import tune_host
from jaxspec.io import datasets
from jaxspec.io.convert import convert
from jaxspec.measure import bench, cost_model, split


def cmd_convert(args) -> int:
    out = convert(
        args.src, args.dst, dtype=args.dtype, quantize=args.quantize, group_size=args.group_size,
        overwrite=args.overwrite,
    )  # fmt: skip
    print(f"converted {args.src} -> {out}")
    return 0


def cmd_bench(args) -> int:
    options = parse_options(args.option)
    target = env.load_target(args)
    tune_host()  # after the load: bench times many warm calls (jaxspec.host says why not sooner)
    draft = env.draft_of(args, target)
    prompts, source = datasets.load(args.dataset, args.prompts)

    def write(result: dict) -> None:  # after each method: a time limit still leaves a JSON
        if args.out:
            path = pathlib.Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=2) + "\n")
            tmp.replace(path)

    result = bench.run(
        target,
        methods=[m for m in args.methods.split(",") if m],
        draft=draft,
        prompts=prompts,
        source=source,
        dataset=args.dataset,
        max_new_tokens=args.max_new_tokens,
        batch=args.batch,
        options=options,
        chat=datasets.chat_template(args.dataset),
        peers=[p for p in args.peers.split(",") if p],
        budget_s=args.budget_s,
        on_update=write,
        time_split=args.time_split,
        kernels=target.kernels,
    )
    if args.out:
        write(result)
        print(f"wrote {args.out}", file=sys.stderr)
    print(bench.table(result))
    clamped = [
        m["method"] for m in result["methods"] if m.get("time_split", {}).get("host_clamped")
    ]
    if clamped:
        print(
            f"* {', '.join(clamped)}: in some run the measured parts exceeded the wall and host "
            "was clamped at 0 there (draft overlapping the verify, or the load changing between "
            "a run and its measurement; overshoot_s in the JSON says by how much)",
            file=sys.stderr,
        )
    return 0


def cmd_profile(args) -> int:
    if args.prompt_tokens < 1:
        raise OptionError(f"--prompt-tokens must be positive, got {args.prompt_tokens}.")
    if args.method == "swiftspec" and len(jax.devices()) < 2:
        raise DeviceError(
            "profiling SwiftSpec needs 2+ devices (target and draft on separate ones); this "
            "machine has 1. On CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2."
        )
    target = env.load_target(args)
    draft = env.draft_of(args, target)
    if args.method == "magicdec":
        return _profile_magicdec(args, target, draft)
    prompt = [int(target.config.bos_token_id or 1)] * args.prompt_tokens
    head = f"{'target':>6} {'draft':>5} {'verify ms':>10} {'expand ms':>10} {'handoff ms':>11} "
    head += f"{'d':>3} {'iteration ms':>13}"
    if args.acceptance:
        head += f" {'implied tok/s':>14}"
    show_head = _header(head)

    def row(p):
        show_head()
        line = f"{p.target_devices:>6} {p.draft_devices:>5} {p.t_verify_ms:>10.3f} "
        line += f"{p.t_draft_ms:>10.3f} {p.handoff_ms:>11.3f} {p.d:>3} {p.iteration_ms:>13.3f}"
        if args.acceptance:
            line += f" {args.acceptance * 1e3 / p.iteration_ms:>14.1f}"
        print(line, flush=True)

    every = split.profile(
        target, draft, prompt, width=args.width, branch=args.branch, bs=args.bs, progress=row,
        kernels=target.kernels,
    )  # fmt: skip
    best = every[0]
    print(
        f"\nbest: target on {best.target_devices} device(s), draft on {best.draft_devices}, "
        f"d = {best.d} (iteration {best.iteration_ms:.3f} ms)"
    )
    scaling = split.tp_scaling(every)
    if len(scaling) > 1:
        form = next((p.tensor_parallel for p in every if p.tensor_parallel), "")
        shown = ", ".join(f"{x}: {s:.2f}x" for x, s in scaling.items())
        print(f"target verify speed-up over tensor-parallel devices ({form}): {shown}")
    return 0


def _header(*lines: str):
    """A table's header, printed by the returned function's first call (with the first row), so
    that an error before any row is printed alone."""
    pending = list(lines)

    def show() -> None:
        while pending:
            print(pending.pop(0))

    return show


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise OptionError(f"{flag} takes comma-separated positive integers, got {text!r}.")
    return values


def _profile_magicdec(args, target, draft) -> int:
    batches = _int_list("--batches", args.batches)
    prefixes = _int_list("--prefixes", args.prefixes or str(args.prompt_tokens))
    gammas = _int_list("--gammas", args.gammas)
    shape = None
    if args.tree:
        depth = tree.TreeShape().depth if args.depth is None else args.depth
        shape = tree.TreeShape(depth, args.width, args.branch, args.bs)
    prompts = None
    if target.tokenizer is not None:  # alpha on real long documents (see jaxspec.io.datasets)

        def prompts(b, p):
            return datasets.longdoc_prompts(target.tokenizer, b, p)

    show_head = _header(
        f"{'batch':>5} {'prefix':>6} {'T_T ms':>8} {'T_D ms':>8} {'alpha':>5} {'slow':>5} "
        f"{'gamma':>5} {'T_V ms':>8} {'speedup':>7}",
        "(alpha: the mean row's; slow: the slowest row's, which the batch waits for and the ",
        " predictions use)",
    )

    def row(r):
        show_head()
        for i, g in enumerate(sorted(r["t_v_ms"])):
            lead = (
                f"{r['batch']:>5} {r['prefix']:>6} {r['t_t_ms']:>8.3f} {r['t_d_ms']:>8.3f} "
                f"{r['alpha']:>5.2f} {r['alpha_slowest_row']:>5.2f}"
                if i == 0
                else " " * 43
            )
            mark = " <" if r["shape"] == "chain" and g == r["gamma"] else ""
            print(f"{lead} {g:>5} {r['t_v_ms'][g]:>8.3f} {r['predicted_speedup'][g]:>6.2f}x{mark}")
        if "tree" in r:
            t = r["tree"]
            mark = " <" if r["shape"] == "tree" else ""
            print(
                f"{'':>43} tree d{t['depth']} w{t['width']} k{t['branch']} bs{t['bs']}: "
                f"T_E {t['t_e']:.3f} ms, T_V {t['t_v']:.3f} ms, accepted length "
                f"{t['acceptance_length']:.2f} (slowest row {t['slowest_length']:.2f}), "
                f"{t['predicted_speedup']:.2f}x{mark}"
            )
        what = f"chain, gamma {r['gamma']}" if r["shape"] == "chain" else "tree"
        print(f"{'':>43} chosen: {what} (predicted {r['speedup']:.2f}x)", flush=True)

    cost_model.table(
        target,
        draft,
        batches,
        prefixes,
        gammas=gammas,
        tree_shape=shape,
        prompts=prompts,
        progress=row,
        budget=args.budget,
        kernels=target.kernels,
    )
    return 0


def cmd_distill(args) -> int:
    # imported here: training (optax and the data pipeline) cost every other command 0.2-0.3 s
    # of import on the 2-core CPU, a twentieth of a warm `jaxspec generate`
    from jaxspec.train.distill import distill, measured_acceptance

    target = env.load_target(args)
    options = {
        f: getattr(args, f) for _, f, _, _ in DISTILL_OPTIONS if getattr(args, f) is not None
    }
    if args.data is not None:
        options["data"] = args.data
    result = distill(
        target,
        args.out,
        resume=args.resume,
        budget_s=args.budget_s,
        gen_budget_s=args.gen_budget_s,
        until_step=args.until_step,
        save_every=args.save_every,
        dtype=args.store_dtype,
        command=provenance.metadata()["command"],
        **options,
    )
    h = result.history[-20:]
    loss = sum(r["loss"] for r in h) / len(h) if h else float("nan")
    agree = sum(r["agree"] for r in h) / len(h) if h else float("nan")
    where = (
        f"checkpoint in {result.path.parent / 'train'} (continue with --resume)"
        if result.stopped == "until_step"
        else f"draft written to {result.path}"
    )
    print(
        f"{result.steps}/{result.total_steps} steps; last loss {loss:.4f}, top-1 agreement "
        f"{agree:.3f}; {where}"
    )
    if result.too_brief and result.stopped != "until_step":
        acc = measured_acceptance(target, result.path)
        print(
            f"warning: only {result.steps} training steps (fewer than a warmup): this draft is "
            f"unlikely to help. Measured acceptance: {acc:.2f} tokens per verification (chain, "
            "gamma 4, 2 held-out HumanEval prompts; 1.0 is no gain). Give --budget-s more time "
            "or --resume the run.",
            file=sys.stderr,
        )
    return 0
