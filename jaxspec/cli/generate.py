"""``jaxspec generate``: the prompts (arguments, a file, standard input), the method's options
(``--option KEY=VALUE``, ``--gamma``, ``--depth``), and the answer printed as its tokens are
accepted."""

from __future__ import annotations

import pathlib
import re
import sys

from jaxspec.api import generate, stream
from jaxspec.cli import env
from jaxspec.errors import OptionError, PromptError
from jaxspec.io import datasets

_INT = re.compile(r"[+-]?\d+")


def option_value(text: str):
    """An ``--option`` value as the engine's options take it: an integer, a number, ``none``,
    or the word itself (``loop=threads``); the engine checks it and names the option if bad."""
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return None if text.lower() == "none" else text


def parse_options(items: list[str], **flags) -> dict:
    """``--option KEY=VALUE`` items (and the flags given, e.g. ``gamma=args.gamma``; None: not
    given) as the method's keyword options."""
    out = {k: v for k, v in flags.items() if v is not None}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not value.strip():
            raise OptionError(f"--option takes KEY=VALUE (e.g. --option width=4), got {item!r}.")
        if key in out:
            twice = f"--{key} and --option {key}" if key in flags else f"--option {key} twice"
            raise OptionError(f"{key} is given twice ({twice}); give it once.")
        out[key] = option_value(value.strip())
    return out


def prompts_of(args) -> list:
    """The prompts in order: the arguments (``-``: all of standard input, as one prompt), then
    ``--prompts-file``'s."""
    prompts = []
    if args.prompt.count("-") > 1:
        raise OptionError("- (standard input) can be given once; it is read as one prompt.")
    for p in args.prompt:
        if p != "-":
            prompts.append(p)
            continue
        text = sys.stdin.read()
        if not text.strip():
            raise PromptError("standard input (-) held no prompt; pipe one in: echo hi | jaxspec …")
        prompts.append(text)
    if args.prompts_file is not None:
        prompts += datasets.file_prompts(pathlib.Path(args.prompts_file).expanduser())
    if not prompts:
        raise OptionError(
            'give a prompt: jaxspec generate "..." (repeat it for several), --prompts-file PATH, '
            "or - to read one from standard input."
        )
    return prompts


def cmd_generate(args) -> int:
    prompts = prompts_of(args)
    options = parse_options(args.option, gamma=args.gamma, depth=args.depth)
    target = env.load_target(args)
    method, draft = env.auto_method(args, target, env.draft_of(args, target), options)
    call = dict(
        draft=draft, method=method, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        chat=not args.raw, progress=env.say, profile_dir=env.home() / "profiles", **options,
    )  # fmt: skip
    if len(prompts) == 1:
        result = _streamed(target, prompts, call)
    else:
        result = generate(target, prompts, **call)
        for i, (tokens, text) in enumerate(zip(result.tokens, _texts(result), strict=True)):
            if i:
                print()
            print(f"--- {i + 1} of {len(prompts)} ---")
            print(text if text is not None else " ".join(map(str, tokens)))
    s = result.stats
    print(
        f"\n[{s['method']}] {s['new_tokens']} tokens in {s['wall_s']:.2f} s = "
        f"{s['tokens_per_s']:.1f} tokens/s (acceptance length {s['acceptance_length']:.2f}; "
        f"compile {s['compile_s']:.1f} s, not counted)",
        file=sys.stderr,
    )
    return 0


def _streamed(target, prompts, call):
    """One prompt's answer printed piece by piece, as the engine accepts its tokens."""
    s = stream(target, prompts, **call)
    for piece in s:
        out = piece.text if piece.text is not None else "".join(f"{t} " for t in piece.tokens)
        sys.stdout.write(out)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return s.result


def _texts(result) -> list:
    return result.text if result.text is not None else [None] * len(result.tokens)
