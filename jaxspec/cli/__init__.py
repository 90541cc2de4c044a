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

import atexit
import logging
import os
import re
import sys
import threading

from jaxspec import distributed, launch
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
            args.kernels = env.kernels(getattr(args, "exact", False))
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


def run() -> None:
    """The ``jaxspec`` command (the console script and ``python -m jaxspec.cli``): ``main``, then
    ``exit_now`` with its code."""
    exit_now(main())


def exit_now(code: int) -> None:
    """End the command's process with ``code``, its output flushed and its exit hooks run, but
    without the interpreter's teardown: freeing XLA's client and its loaded programs took about
    0.7 s of a warm ``jaxspec generate`` on the 2-core CPU (6.3 -> 5.0 s wall, two runs
    each). A process with other threads still running, or in a distributed job, exits the
    usual way."""
    sys.stdout.flush()
    sys.stderr.flush()
    alone = threading.active_count() == 1 and distributed.session() is None
    if not alone:
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["COMMANDS", "build_parser", "cli_message", "exit_now", "main", "run"]
