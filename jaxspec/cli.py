"""The ``jaxspec`` command line: convert, generate, bench, profile, distill.

Every user error is a JaxspecError: printed as ``error: ...`` on stderr, exit code 2. This is the
only module that reads environment variables that change compiled programs (``kernels()``:
``KernelConfig.from_env``), besides the benchmark scripts.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

from jaxspec import launch, provenance
from jaxspec.api import generate
from jaxspec.engines import tree
from jaxspec.errors import DeviceError, JaxspecError, OptionError
from jaxspec.io import datasets
from jaxspec.io.convert import convert, load
from jaxspec.io.default_model import default_checkpoint
from jaxspec.io.draft_checkpoint import is_draft_checkpoint, load_draft, shipped_draft
from jaxspec.kernels import KernelConfig
from jaxspec.measure import bench, cost_model, split
from jaxspec.train.data import DataSpec
from jaxspec.train.distill import distill, measured_acceptance
from jaxspec.train.recipe import Recipe

DRAFT_KINDS = ("self-streaming", "self-snapkv", "ngram")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="converted checkpoint folder (default: the embedded SmolLM2-135M-Instruct, "
        "converted once into checkpoints/)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="compute dtype; auto = float32 on CPU, bfloat16 on GPU (default: auto)",
    )
    p.add_argument(
        "--quantized",
        default="auto",
        choices=("auto", "keep", "dequantize"),
        help="a quantized checkpoint (a GGUF's Q8_0/Q4_0/Q4_1 blocks, AWQ, convert --quantize): "
        "keep its weights quantized or dequantize them once at load; auto (default): the "
        "backend's choice, jaxspec.io.convert.KEEP_QUANTIZED (kept on a CPU and a GPU)",
    )


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--method",
        default="auto",
        choices=("auto", "autoregressive", "chain", "tree", "swiftspec", "magicdec"),
        help="auto (default): chain with --draft when one is given, or on a GPU with the "
        "shipped distilled draft when the model is the embedded default; else autoregressive",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft checkpoint folder (converted model or `jaxspec distill` output), or one of "
        f"{', '.join(DRAFT_KINDS)}",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gamma", type=int, default=None, help="chain: draft tokens per verification")
    p.add_argument("--depth", type=int, default=None, help="tree: draft expansions per tree")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxspec",
        description="Lossless speculative decoding in JAX (SwiftSpec- and MagicDec-style engines).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser(
        "convert",
        help="convert an HF folder or a .gguf file to an Orbax checkpoint",
        description="Convert an HF checkpoint folder (config.json + safetensors) or "
        "a .gguf file into a jaxspec (Orbax) checkpoint folder.",
    )
    c.add_argument("src", help="HF folder or .gguf file")
    c.add_argument("dst", help="output folder (must not exist, or use --overwrite)")
    c.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of float weights, and the compute dtype of quantized ones",
    )
    c.add_argument(
        "--quantize",
        default="source",
        choices=("source", "none", "int8", "int4"),
        help="source (default): keep a GGUF's Q8_0/Q4_0/Q4_1 blocks and AWQ weights quantized "
        "(other GGUF types are dequantized, with a note); none: dequantize everything; int8: "
        "quantize the projections and LM head, a scale per output channel (or per "
        "--group-size rows); int4: the same in groups of --group-size (128) rows",
    )
    c.add_argument(
        "--group-size", type=int, default=None, help="rows of a weight a scale covers (int8/int4)"
    )
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing dst that is a jaxspec checkpoint or draft (never the source, "
        "a folder holding it, or a folder with other files)",
    )

    g = sub.add_parser(
        "generate",
        help="generate an answer to a prompt",
        description="Generate text for one prompt. With no --model, uses the "
        "embedded SmolLM2-135M-Instruct and its chat template.",
    )
    g.add_argument("prompt", help="the prompt text")
    _add_model_args(g)
    _add_generation_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    launch.add_job_args(g)

    b = sub.add_parser(
        "bench",
        help="run methods over a real prompt set; write JSON and print a table",
        description="Runs each method over the prompts (one warm-up batch each, excluded) and "
        "writes per-prompt and overall tokens/s, acceptance length, ms per token (mean, p50, "
        "p95) and the time split (draft, verify, handoff, prefill, host: component timings x "
        "counts), with device, jax version, commit and command.",
    )
    _add_model_args(b)
    b.add_argument(
        "--methods",
        default="autoregressive,chain,tree",
        help="comma-separated methods (default: autoregressive,chain,tree)",
    )
    b.add_argument(
        "--draft",
        default="ngram",
        help="draft checkpoint folder, or self-streaming / ngram (default: ngram)",
    )
    b.add_argument(
        "--dataset",
        default="humaneval",
        help="humaneval, chat (MT-Bench, chat template applied) or file:PATH",
    )
    b.add_argument("--prompts", type=int, default=8, help="how many prompts (default 8)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--batch", type=int, default=1)
    b.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="method option, repeatable (e.g. --option gamma=4 --option depth=3); "
        "swiftspec's loop takes a word (--option loop=device)",
    )
    b.add_argument(
        "--peers",
        default="",
        help="comma-separated HF transformers peers run in the same bench: hf (plain greedy "
        "generate), hf-assisted (assisted generation with the same draft); default: none",
    )
    b.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="time limit: past it no new batch, method or peer starts; the JSON (written after "
        "each method and peer) keeps what finished",
    )
    b.add_argument(
        "--time-split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure each method's time split (draft, verify, handoff, prefill, host) by "
        "timing its pieces in isolation at each batch's shapes and multiplying by the run's "
        "counts; costs extra time outside every measured wall (default: on)",
    )
    b.add_argument("--out", default=None, help="write the JSON here")
    launch.add_job_args(b)
    launch.add_parser(sub)

    pr = sub.add_parser(
        "profile",
        help="measure SwiftSpec's workers on every device split; pick the split and d",
        description="Times one target verify of --bs tree nodes, one draft expansion of --width "
        "leaves and the handoffs for each device split this machine allows, and picks d (draft "
        "expansions per verification) that hides the draft behind the verify. method="
        "'swiftspec' runs this itself when its options leave the split or depth open.",
    )
    _add_model_args(pr)
    pr.add_argument("--draft", required=True, help="draft checkpoint folder, or self-streaming")
    pr.add_argument("--prompt-tokens", type=int, default=512, help="prefix length to profile at")
    pr.add_argument("--width", type=int, default=8)
    pr.add_argument("--branch", type=int, default=4)
    pr.add_argument("--bs", type=int, default=8)
    pr.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help="also print the tokens/s implied at this acceptance length",
    )
    pr.add_argument(
        "--method",
        default="swiftspec",
        choices=("swiftspec", "magicdec"),
        help="swiftspec (default): device split and d; magicdec: the cost-model table (T_T, "
        "T_D, T_V(gamma), alpha, predicted speedup per gamma, chosen gamma and shape) per batch "
        "and prefix",
    )
    pr.add_argument("--batches", default="1", help="magicdec: comma-separated batch sizes")
    pr.add_argument(
        "--prefixes", default=None, help="magicdec: comma-separated prefix lengths "
        "(default: --prompt-tokens)",
    )  # fmt: skip
    pr.add_argument("--gammas", default="1,2,3,4,5,6,7,8", help="magicdec: gammas to measure")
    pr.add_argument("--budget", type=int, default=256, help="magicdec: the draft's KV budget")
    pr.add_argument(
        "--tree", action="store_true", help="magicdec: also measure a batched tree (--depth, "
        "--width, --branch, --bs) and compare it with the chains",
    )  # fmt: skip
    pr.add_argument("--depth", type=int, default=4, help="magicdec --tree: expansions per tree")
    _add_distill_parser(sub)
    return parser


# (flag, Recipe/DataSpec field, type, help): distill's training and data options. Defaults are
# None here so that --resume can tell the options given from those left at their defaults.
DISTILL_OPTIONS = (
    (
        "--kind",
        "kind",
        str,
        "model (a small decoder) or feature (an EAGLE-1 head over the "
        "target's hidden states; layers default 1, init random)",
    ),
    ("--layers", "layers", int, "decoder layers of the draft"),
    ("--intermediate", "intermediate", int, "MLP width of the draft"),
    ("--init", "init", str, "copy (the target's first layers, MLP trimmed), copy-spread, random"),
    ("--seq-len", "seq_len", int, "tokens per training window"),
    ("--batch", "batch", int, "windows per step"),
    ("--steps", "steps", int, "the most optimizer steps (a --budget-s may fix fewer)"),
    ("--lr", "lr", float, "peak AdamW learning rate"),
    ("--min-lr-ratio", "min_lr_ratio", float, "final learning rate / peak (cosine)"),
    ("--warmup", "warmup", int, "linear warmup steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (matrices only)"),
    ("--clip", "clip", float, "global gradient-norm clip"),
    ("--ce-weight", "ce_weight", float, "weight of CE on the target's greedy token beside KL"),
    ("--feature-weight", "feature_weight", float, "feature kind: weight of the state regression"),
    ("--token-weight", "token_weight", float, "feature kind: weight of the token loss"),
    ("--noise", "noise", float, "feature kind: width of the uniform noise on the input states"),
    ("--seed", "seed", int, "data-order seed"),
    ("--samples", "samples", int, "temperature samples per prompt, besides the greedy one"),
    ("--temperature", "temperature", float, "temperature of those samples"),
    ("--max-new-tokens", "max_new", int, "tokens the target writes per prompt"),
    ("--gen-batch", "gen_batch", int, "rows per generation batch"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "longer prompts keep their last tokens"),
    ("--data-seed", "data_seed", int, "sampling seed of the data"),
)


def _add_distill_parser(sub) -> None:
    defaults = {**vars(DataSpec()), **vars(Recipe()), "data_seed": DataSpec().seed}
    d = sub.add_parser(
        "distill",
        help="train a small draft for a target on text the target writes",
        description="Distil a small draft (a few decoder layers, the target's tokenizer, "
        "embedding and LM head shared) from the target's own greedy and sampled continuations "
        "of real prompts (the first 20 HumanEval prompts are held out): KL(target || draft) "
        "over the full vocabulary plus CE on the target's greedy token, AdamW with warmup and "
        "cosine decay, Orbax checkpoints (--resume). --kind feature trains an EAGLE-1 head "
        "instead (one decoder layer over the target's final hidden state and the next token; "
        "loss: state regression + token KL). The draft lands in OUT/draft; use it with "
        "--draft OUT in generate, bench and profile.",
    )
    d.add_argument(
        "--target",
        default=None,
        help="the target's converted checkpoint (default: the embedded SmolLM2-135M-Instruct)",
    )
    d.add_argument("--out", required=True, help="run folder: data/, train/ and the draft/")
    d.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="compute dtype; auto = float32 on CPU, bfloat16 on GPU (default: auto)",
    )
    d.add_argument(
        "--data",
        default=None,
        help="comma-separated prompt sets (humaneval, chat, stdlib, longdoc, file:PATH; "
        "NAME@chat / NAME@raw force the chat template) (default: humaneval,chat)",
    )
    for flag, field, typ, text in DISTILL_OPTIONS:
        d.add_argument(
            flag, dest=field, type=typ, default=None, help=f"{text} (default: {defaults[field]})"
        )
    d.add_argument("--resume", action="store_true", help="continue the run in --out")
    d.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop the whole run (data + training) within about this many seconds",
    )
    d.add_argument(
        "--gen-budget-s", type=float, default=None, help="seconds for data (default: 40%% of it)"
    )
    d.add_argument("--until-step", type=int, default=None, help="stop after this step")
    d.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    d.add_argument(
        "--store-dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of the stored draft (default: bfloat16)",
    )


def kernels() -> KernelConfig:
    """The kernel configuration the ``JAXSPEC_*`` variables set (``KernelConfig.from_env``):
    read once per command, here and in the benchmark scripts only."""
    return KernelConfig.from_env()


def _dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.dtype(name)


def _quantized(args) -> bool | None:
    """``--quantized`` as ``load``'s ``quantized`` (None: the backend's default)."""
    return {"auto": None, "keep": True, "dequantize": False}[getattr(args, "quantized", "auto")]


def _load_target(args):
    path = args.model or default_checkpoint()
    model = load(
        path, dtype=_dtype(args.dtype), mesh=launch.target_mesh(args), quantized=_quantized(args)
    )
    model.kernels = args.kernels
    return model


def _load_draft(args, target):
    if args.draft is None or args.draft in DRAFT_KINDS:
        return args.draft
    if is_draft_checkpoint(args.draft):  # distilled: shares the target's embedding
        return load_draft(args.draft, target)
    model = load(args.draft, dtype=_dtype(args.dtype), quantized=_quantized(args))
    model.kernels = target.kernels
    return model


def _auto_method(args, target, draft):
    """``--method auto``: chain with the given draft, or on a GPU with the shipped distilled
    draft for the embedded default model (when it is there and matches), else autoregressive.
    On a CPU the shipped draft measured 0.71x autoregressive (benchmarks/results/distill.json):
    its LM head costs a quarter of a target step there."""
    if args.method != "auto":
        return args.method, draft
    if draft is not None:
        return "chain", draft
    given = [f"--{k}" for k in ("gamma", "depth") if getattr(args, k, None) is not None]
    if given:
        raise OptionError(
            f"{' and '.join(given)} shape speculation, which needs a draft: add --draft ngram "
            "(prompt lookup), --draft self-streaming, or --draft PATH (a checkpoint)."
        )
    if args.model is None and jax.default_backend() == "gpu":
        shipped = shipped_draft(target)
        if shipped is not None:
            return "chain", shipped
    return "autoregressive", None


def _method_options(args) -> dict:
    opts = {}
    if args.gamma is not None:
        opts["gamma"] = args.gamma
    if args.depth is not None:
        opts["depth"] = args.depth
    return opts


def cmd_convert(args) -> int:
    out = convert(
        args.src, args.dst, dtype=args.dtype, quantize=args.quantize, group_size=args.group_size,
        overwrite=args.overwrite,
    )  # fmt: skip
    print(f"converted {args.src} -> {out}")
    return 0


def cmd_generate(args) -> int:
    target = _load_target(args)
    method, draft = _auto_method(args, target, _load_draft(args, target))
    result = generate(
        target,
        args.prompt,
        draft=draft,
        method=method,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        chat=not args.raw,
        **_method_options(args),
    )
    print(result.text[0] if result.text else result.tokens[0])
    s = result.stats
    print(
        f"\n[{s['method']}] {s['new_tokens']} tokens in {s['wall_s']:.2f} s = "
        f"{s['tokens_per_s']:.1f} tokens/s (acceptance length {s['acceptance_length']:.2f}; "
        f"compile {s['compile_s']:.1f} s, not counted)",
        file=sys.stderr,
    )
    return 0


WORD_OPTIONS = ("loop",)  # method options whose value is a word, not an integer


def cmd_bench(args) -> int:
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if sep and key in WORD_OPTIONS and value:  # the engine checks the word
            options[key] = value
            continue
        if not sep or not value.lstrip("-").isdigit():
            raise OptionError(f"--option takes KEY=INT, got {item!r}.")
        options[key] = int(value)
    target = _load_target(args)
    draft = _load_draft(args, target)
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
    target = _load_target(args)
    draft = _load_draft(args, target)
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
        shape = tree.TreeShape(args.depth, args.width, args.branch, args.bs)
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
    target = load(args.target or default_checkpoint(), dtype=_dtype(args.dtype))
    target.kernels = args.kernels
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


def _check_before_work(args) -> None:
    """What can be refused before a model loads: an --out that cannot be written (bench writes
    a file, distill a folder) and a --draft that is neither a folder nor a known kind."""
    import pathlib

    from jaxspec.errors import DraftError
    from jaxspec.io.paths import check_output_path

    if getattr(args, "out", None) is not None:
        check_output_path(args.out, "--out", folder=args.command == "distill")
    draft = getattr(args, "draft", None)
    if draft is None or draft in DRAFT_KINDS or pathlib.Path(draft).expanduser().exists():
        return
    import difflib

    close = difflib.get_close_matches(draft, DRAFT_KINDS, n=1)
    raise DraftError(
        f"--draft {draft!r} is neither a folder nor a known draft kind; give a draft checkpoint "
        f"folder or one of {', '.join(DRAFT_KINDS)}"
        + (f" (did you mean {close[0]}?)." if close else ".")
    )


COMMANDS = {
    "convert": cmd_convert,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "profile": cmd_profile,
    "distill": cmd_distill,
    "launch": launch.cmd_launch,
}


# Python parameter names in the library's messages, as the CLI's flags
FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "overwrite=True (CLI: --overwrite)": "--overwrite",
    "resume=True (CLI: --resume)": "--resume",
    "budget_s": "--budget-s",
    "group_size": "--group-size",
    "quantize=": "--quantize ",
}


def cli_message(text: str) -> str:
    """A library message in the CLI's words: parameter names become flags."""
    for name, flag in FLAGS.items():
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w])", flag, text)
    return text


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command != "convert":  # a bad kernel setting fails before any work
            args.kernels = kernels()
        _check_before_work(args)
        argv = sys.argv[1:] if argv is None else list(argv)
        return launch.run(args, argv, lambda: COMMANDS[args.command](args))
    except JaxspecError as e:
        print(f"error: {cli_message(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the writers have already removed what they had begun
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
