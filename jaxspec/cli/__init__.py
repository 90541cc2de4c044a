"""The ``jaxspec`` command line: convert, generate, bench, profile, distill (``jaxspec --help``).

Every user error is a JaxspecError: printed as ``error: ...`` on stderr, exit code 2. This
package is the only place that reads environment variables, besides the benchmark scripts: the
``JAXSPEC_*`` kernel settings (``KernelConfig.from_env``) and ``JAXSPEC_HOME``, the per-user
folder of converted checkpoints and of JAX's compilation cache, which every command but convert
turns on (``--no-compile-cache`` keeps it off). Modules: ``parser`` (the arguments), ``env``
(folders, compile cache, models from the arguments, progress lines), ``generate`` (prompts,
options, streamed answers) and ``commands`` (convert, bench, profile, distill).
"""

from __future__ import annotations

import re
import sys

from jaxspec import launch
from jaxspec.cli import env
from jaxspec.cli.commands import cmd_bench, cmd_convert, cmd_distill, cmd_profile
from jaxspec.cli.generate import cmd_generate
from jaxspec.cli.parser import build_parser
from jaxspec.errors import JaxspecError

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
            args.kernels = env.kernels()
            env.use_compile_cache(getattr(args, "compile_cache", True))
        env.check_before_work(args)
        argv = sys.argv[1:] if argv is None else list(argv)
        return launch.run(args, argv, lambda: COMMANDS[args.command](args))
    except JaxspecError as e:
        print(f"error: {cli_message(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the writers have already removed what they had begun
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "build_parser", "cli_message", "main"]
