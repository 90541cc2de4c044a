"""The command line's arguments: one parser per command, sharing the model, generation and
compile-cache arguments."""

from __future__ import annotations

import argparse

import jax

import jaxspec
from jaxspec import launch
from jaxspec.api import METHODS
from jaxspec.train.data import DataSpec
from jaxspec.train.recipe import Recipe

DRAFT_KINDS = ("self-streaming", "self-snapkv", "ngram")
DATASETS = (
    "humaneval, chat (MT-Bench, chat template applied), arena, ifeval (real user requests), "
    "longdoc, stdlib or file:PATH"
)
OPTION_HELP = (
    "a method option, repeatable: --option width=4 --option loop=threads (an integer, a "
    "number or a word; the method checks it: see the README's Methods table)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxspec",
        description="Lossless speculative decoding in JAX (SwiftSpec- and MagicDec-style engines).",
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _convert(sub)
    _generate(sub)
    _bench(sub)
    _profile(sub)
    _distill(sub)
    launch.add_parser(sub)
    return parser


def version() -> str:
    return f"jaxspec {jaxspec.__version__} (jax {jax.__version__})"


def _add_model_args(p: argparse.ArgumentParser, *, flag: str = "--model") -> None:
    p.add_argument(
        flag,
        dest="model",
        default=None,
        help="a converted checkpoint folder, or an HF model folder or .gguf file, converted "
        "once into the checkpoint cache (checkpoints/ of a checkout, else $JAXSPEC_HOME or "
        "~/.cache/jaxspec); default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype; auto = float32 on CPU, bfloat16 on GPU (default: auto)",
    )
    p.add_argument(
        "--quantized",
        default="auto",
        choices=("auto", "keep", "dequantize"),
        help="a quantized checkpoint (a GGUF's Q8_0/Q4_0/Q4_1 blocks, AWQ, convert --quantize): "
        "keep its weights quantized or dequantize them once at load; auto (default): the "
        "backend's choice, jaxspec.io.convert.KEEP_QUANTIZED (on a GPU kept where Hopper's WGMMA "
        "kernel takes them, as on a Llama-3-8B-shape model, else dequantized, as on a CPU: "
        "there the kept weights measured slower)",
    )
    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not keep compiled programs in the per-user cache ($JAXSPEC_HOME/xla or "
        "~/.cache/jaxspec/xla), which a second run of the same shapes reads instead of compiling",
    )


def draft_vocab(text: str) -> int | str | None:
    """``--draft-vocab``: a number of tokens, ``default`` or ``full``."""
    if text in ("default", "full"):
        return None if text == "full" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of tokens, default or full"
        ) from None


def _add_draft_vocab(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-vocab",
        type=draft_vocab,
        default="default",
        metavar="N|default|full",
        help="a distilled draft predicts over the N tokens most frequent in its distill data "
        "(lossless: the target verifies; jaxspec.model.vocab_head); default: "
        "vocab_head.DEFAULT_SIZE where the draft has token counts; full: the whole vocabulary",
    )


def _add_exact(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--exact",
        action="store_true",
        help="invariant numerics (KernelConfig(invariant=True)): a row's result does not depend "
        "on the other rows of its step, so speculative output equals autoregressive output bit "
        "for bit in bfloat16 too; slower (on an H200 0.02-0.07x the default tokens/s at batch "
        "16, 0.17-0.41x at batch 1: benchmarks/RESULTS.md, bit_exact)",
    )


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--method",
        default="auto",
        choices=("auto", *METHODS),
        help="auto (default): chain with --draft when one is given, or on a GPU with the "
        "shipped distilled draft when the model is the embedded default; else autoregressive",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft checkpoint folder (converted model or `jaxspec distill` output), or one of "
        f"{', '.join(DRAFT_KINDS)}",
    )
    _add_draft_vocab(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gamma", type=int, default=None,
        help="draft tokens per verification (chain; magicdec, whose default measures it)",
    )  # fmt: skip
    p.add_argument(
        "--depth", type=int, default=None,
        help="draft expansions per tree (tree; swiftspec's d; magicdec's trees)",
    )  # fmt: skip
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help=OPTION_HELP)


def _convert(sub) -> None:
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


def _generate(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="generate answers to prompts, printed as the tokens are accepted",
        description="Generate text for one or more prompts. One prompt is printed as its "
        "tokens are accepted (SwiftSpec prints at the end); several are decoded as one batch. "
        "With no --model, uses the embedded SmolLM2-135M-Instruct and its chat template.",
    )
    g.add_argument(
        "prompt",
        nargs="*",
        help="a prompt; repeat for several; - reads one prompt from standard input",
    )
    g.add_argument(
        "--prompts-file",
        default=None,
        metavar="PATH",
        help="more prompts: a JSON list (.json), one JSON string per line (.jsonl), or one "
        "prompt per line (any other file)",
    )
    _add_model_args(g)
    _add_generation_args(g)
    _add_exact(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    launch.add_job_args(g)


def _bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="run methods over a real prompt set; write JSON and print a table",
        description="Runs each method over the prompts (one warm-up batch each, excluded) and "
        "writes per-prompt and overall tokens/s, acceptance length, ms per token (mean, p50, "
        "p95) and the time split (draft, verify, handoff, prefill, host: component timings x "
        "counts), with device, jax version, commit and command.",
    )
    _add_model_args(b)
    _add_exact(b)
    b.add_argument(
        "--methods",
        default="autoregressive,chain,tree",
        help="comma-separated methods (default: autoregressive,chain,tree)",
    )
    b.add_argument(
        "--draft",
        default="ngram",
        help=f"draft checkpoint folder, or one of {', '.join(DRAFT_KINDS)} (default: ngram)",
    )
    _add_draft_vocab(b)
    b.add_argument("--dataset", default="humaneval", help=f"{DATASETS} (default: humaneval)")
    b.add_argument("--prompts", type=int, default=8, help="how many prompts (default 8)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help=OPTION_HELP)
    b.add_argument(
        "--peers",
        default="",
        help="comma-separated HF transformers peers run in the same bench: hf (plain greedy "
        "generate), hf-assisted (assisted generation with the same draft); default: none. "
        "They need torch: pip install 'jaxspec[peers]'",
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


def _profile(sub) -> None:
    pr = sub.add_parser(
        "profile",
        help="measure SwiftSpec's workers on every device split; pick the split and d",
        description="Times one target verify of --bs tree nodes, one draft expansion of --width "
        "leaves and the handoffs for each device split this machine allows, and picks d (draft "
        "expansions per verification) that hides the draft behind the verify. method="
        "'swiftspec' runs this itself when its options leave the split or depth open.",
    )
    _add_model_args(pr)
    _add_exact(pr)
    pr.add_argument(
        "--draft",
        required=True,
        help="draft checkpoint folder, or self-streaming (swiftspec, magicdec) or self-snapkv "
        "(magicdec)",
    )
    _add_draft_vocab(pr)
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
    pr.add_argument(
        "--depth", type=int, default=None,
        help="magicdec --tree: expansions per tree (default: the tree engine's, 3)",
    )  # fmt: skip


# (flag, Recipe/DataSpec field, type, help): distill's training and data options. Defaults are
# None here so that --resume can tell the options given from those left at their defaults.
DISTILL_OPTIONS = (
    (
        "--kind",
        "kind",
        str,
        "model (a small decoder) or feature (an EAGLE head over the "
        "target's hidden states, --reads; layers default 1, init random)",
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
    (
        "--ttt-steps",
        "ttt_steps",
        int,
        "feature kind: runs of the head per position, the later ones on its own predicted "
        "states (training-time test; 1: EAGLE-1's loss alone)",
    ),
    (
        "--init-from",
        "init_from",
        str,
        "start from this finished draft folder (same kind and MLP width) instead of --init; "
        "a draft of fewer layers is grown to --layers, its added layers starting as the "
        "identity",
    ),
    (
        "--reads",
        "reads",
        str,
        "feature kind: the target states the head reads, comma-separated layer indices and "
        "final (e.g. 1,14,final: EAGLE-3's fused low, middle and final states; default final: "
        "EAGLE-1's); with --init-from an EAGLE-1 head, it starts reading the final state alone",
    ),
    ("--seed", "seed", int, "data-order seed"),
    ("--samples", "samples", int, "temperature samples per prompt, besides the greedy one"),
    ("--temperature", "temperature", float, "temperature of those samples"),
    ("--max-new-tokens", "max_new", int, "tokens the target writes per prompt"),
    ("--gen-batch", "gen_batch", int, "rows per generation batch"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "longer prompts keep their last tokens"),
    ("--data-seed", "data_seed", int, "sampling seed of the data"),
)


def _distill(sub) -> None:
    defaults = {**vars(DataSpec()), **vars(Recipe()), "data_seed": DataSpec().seed}
    d = sub.add_parser(
        "distill",
        help="train a small draft for a target on text the target writes",
        description="Distil a small draft (a few decoder layers, the target's tokenizer, "
        "embedding and LM head shared) from the target's own greedy and sampled continuations "
        "of real prompts (the first 20 HumanEval prompts are held out): KL(target || draft) "
        "over the full vocabulary plus CE on the target's greedy token, AdamW with warmup and "
        "cosine decay, Orbax checkpoints (--resume). --kind feature trains an EAGLE head "
        "instead (one decoder layer over the target's final hidden state, or with --reads its "
        "fused layers, and the next token; loss: state regression + token KL, --ttt-steps "
        "EAGLE-3's training-time test). The draft lands in OUT/draft; use it with "
        "--draft OUT in generate, bench and profile.",
    )
    _add_model_args(d, flag="--target")
    d.add_argument("--out", required=True, help="run folder: data/, train/ and the draft/")
    d.add_argument(
        "--data",
        default=None,
        help="comma-separated prompt sets (humaneval, chat, arena, ifeval, stdlib, longdoc, "
        "file:PATH; "
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
