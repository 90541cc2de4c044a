"""What a command takes from its surroundings: the environment variables (``JAXSPEC_HOME``, the
``JAXSPEC_*`` kernel settings), the per-user folders (converted checkpoints, the compilation
cache), the models the arguments name (converting an HF folder or a GGUF file once), and the
messages on stderr while the user waits."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

from jaxspec import launch
from jaxspec.cli.parser import DRAFT_KINDS
from jaxspec.errors import DraftError, OptionError
from jaxspec.io import places
from jaxspec.io.convert import is_source, load
from jaxspec.io.default_model import complete, converted, default_checkpoint
from jaxspec.io.draft_checkpoint import is_draft_checkpoint, load_draft, shipped_draft
from jaxspec.io.paths import check_output_path
from jaxspec.kernels import KernelConfig


def say(message: str) -> None:
    """A progress line on stderr (a measurement or a compile is starting)."""
    print(f"{message} ...", file=sys.stderr, flush=True)


def home() -> pathlib.Path:
    """The per-user folder: ``$JAXSPEC_HOME``, else ``~/.cache/jaxspec``."""
    return places.home(os.environ.get("JAXSPEC_HOME") or None)


def checkpoints() -> pathlib.Path:
    """Where the embedded default model is converted: the checkout's ``checkpoints/`` (where
    ``make demo`` put it), else ``home()``'s."""
    return places.checkpoints(os.environ.get("JAXSPEC_HOME") or None)


def source_cache() -> pathlib.Path:
    """Where ``--model``'s HF folders and .gguf files are converted once: ``$JAXSPEC_HOME``'s
    ``checkpoints/`` when it is set (the user's choice, the test suite's temporary folder),
    else ``checkpoints()``."""
    given = os.environ.get("JAXSPEC_HOME")
    return places.home(given) / "checkpoints" if given else checkpoints()


def use_compile_cache(enabled: bool) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache in ``home()/xla`` (unless ``enabled`` is false,
    or the user already named a folder with ``JAX_COMPILATION_CACHE_DIR``): a second run of the
    same programs on this machine reads them instead of compiling. Every program is kept, however
    quick its compile (JAX's default keeps those over a second). ``JAXSPEC_COMPILE_CACHE=off``
    keeps it off too (the test suite's setting: one process runs many CLI calls, and a cache
    turned on by the first would write every later compile to disk). Returns the folder in use."""
    if not enabled or os.environ.get("JAXSPEC_COMPILE_CACHE", "").lower() in ("off", "0", "no"):
        return None
    if jax.config.jax_compilation_cache_dir:
        return pathlib.Path(jax.config.jax_compilation_cache_dir)
    folder = home() / "xla"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def kernels(exact: bool = False) -> KernelConfig:
    """The kernel configuration the ``JAXSPEC_*`` variables set (``KernelConfig.from_env``):
    read once per command, here and in the benchmark scripts only; ``exact`` (``--exact``)
    turns on the invariant numerics."""
    k = KernelConfig.from_env()
    return dataclasses.replace(k, invariant=True) if exact else k


def dtype_name(name: str) -> str:
    if name == "auto":
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return name


def model_path(spec: str | None, dtype: str) -> pathlib.Path:
    """The converted checkpoint a ``--model`` names: the embedded default model, a converted
    folder as given, or an HF folder / .gguf file converted once into ``source_cache()`` (in
    ``dtype``; a changed source is converted again, into a folder of its own)."""
    if spec is None:
        return default_checkpoint(checkpoints())
    src = pathlib.Path(spec).expanduser().absolute()
    if not is_source(src):
        return src
    dst = source_cache() / f"{src.stem if src.is_file() else src.name}-{dtype}-{_digest(src)}"
    if not complete(dst):
        print(f"converting {src} once into {dst} (later runs load it from there)", file=sys.stderr)
    return converted(src, dst, dtype=dtype, progress=True)


def _digest(src: pathlib.Path) -> str:
    """Names the source and its files' sizes and times: a changed source gets a new folder."""
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    h = hashlib.sha256(str(src).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def quantized(args) -> bool | None:
    """``--quantized`` as ``load``'s ``quantized`` (None: the backend's default)."""
    return {"auto": None, "keep": True, "dequantize": False}[getattr(args, "quantized", "auto")]


def load_target(args):
    """The target model of ``--model`` (or distill's ``--target``) in ``--dtype``."""
    dtype = dtype_name(args.dtype)
    model = load(
        model_path(args.model, dtype), dtype=jnp.dtype(dtype), mesh=launch.target_mesh(args),
        quantized=quantized(args),
    )  # fmt: skip
    model.kernels = args.kernels
    return model


def draft_of(args, target):
    """``--draft``: None, a kind (``DRAFT_KINDS``), a distilled draft or a converted model."""
    if args.draft is None or args.draft in DRAFT_KINDS:
        return args.draft
    if is_draft_checkpoint(args.draft):  # distilled: shares the target's embedding
        return load_draft(args.draft, target, vocab=args.draft_vocab)
    dtype = dtype_name(args.dtype)
    model = load(model_path(args.draft, dtype), dtype=jnp.dtype(dtype), quantized=quantized(args))
    model.kernels = target.kernels
    return model


def auto_method(args, target, draft, options: dict):
    """``--method auto``: chain with the given draft, or for the embedded default model with its
    shipped feature head (EAGLE-1), else its small draft, when one is there and matches; else
    autoregressive. With their heads cut to the most frequent tokens (``model.vocab_head``) the
    feature head's chain ran 1.78x autoregressive on a CPU (float32, held-out HumanEval) and
    1.14x on the chat set, the small draft's 1.34x and 0.87x; on an H100 1.69x against 1.22x
    (benchmarks/RESULTS.md: distill, feature_draft)."""
    if args.method != "auto":
        return args.method, draft
    if draft is not None:
        return "chain", draft
    if options:
        flags = ", ".join(f"--{k}" if k in ("gamma", "depth") else f"--option {k}" for k in options)
        raise OptionError(
            f"{flags} shape speculation, which needs a draft: add --draft ngram (prompt "
            "lookup), --draft self-streaming, or --draft PATH (a checkpoint)."
        )
    if args.model is None:
        for kind in ("feature", "model"):
            shipped = shipped_draft(target, kind=kind, vocab=args.draft_vocab)
            if shipped is not None:
                return "chain", shipped
    return "autoregressive", None


# XLA options that make the engines' programs compute wrong tokens, and why
UNSAFE_XLA_FLAGS = {
    "xla_gpu_deterministic_ops": (
        "under it XLA rewrites scatters, and the rewrite lost updates of the engines' drop-mode "
        "writes on an H200 (jax 0.11.2): a tree verify emitted its root token again in place "
        "of the accepted child (benchmarks/notes/bit_exact.md)"
    ),
}


def check_xla_flags(flags: str) -> None:
    """Refuse an ``XLA_FLAGS`` value that turns on an option of ``UNSAFE_XLA_FLAGS``."""
    for word in flags.split():
        name, _, value = word.lstrip("-").partition("=")
        if name in UNSAFE_XLA_FLAGS and value.lower() not in ("false", "0"):
            raise OptionError(
                f"XLA_FLAGS sets --{name}: {UNSAFE_XLA_FLAGS[name]}. Remove it from XLA_FLAGS; "
                "for output equal to autoregressive decoding bit for bit, pass --exact instead."
            )


def check_before_work(args) -> None:
    """What can be refused before a model loads: XLA options that make wrong tokens
    (``check_xla_flags``), an --out that cannot be written (bench writes a file, distill a
    folder) and a --draft that is neither a folder nor a known kind."""
    check_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if getattr(args, "out", None) is not None:
        check_output_path(args.out, "--out", folder=args.command == "distill")
    draft = getattr(args, "draft", None)
    if draft is None or draft in DRAFT_KINDS or pathlib.Path(draft).expanduser().exists():
        return
    close = difflib.get_close_matches(draft, DRAFT_KINDS, n=1)
    raise DraftError(
        f"--draft {draft!r} is neither a folder nor a known draft kind; give a draft checkpoint "
        f"folder or one of {', '.join(DRAFT_KINDS)}"
        + (f" (did you mean {close[0]}?)." if close else ".")
    )
