"""jaxspec: lossless speculative decoding in JAX.

The path of a request: ``convert`` (HF folder or .gguf -> Orbax) -> ``load`` -> ``Model`` ->
``generate(target, prompts, draft=..., method=...)`` -> the engine's loop -> ``GenerationResult``.
"""

import importlib.metadata

from jaxspec.api import GenerationResult, Piece, Stream, generate, stream
from jaxspec.config import ModelConfig
from jaxspec.engines import ENGINES
from jaxspec.errors import (
    CheckpointError,
    DeviceError,
    DraftError,
    JaxspecError,
    OptionError,
    PromptError,
    WorkerError,
)
from jaxspec.host import tune_host
from jaxspec.io.convert import convert, load
from jaxspec.io.draft_checkpoint import load_draft
from jaxspec.kernels import KernelConfig
from jaxspec.model.transformer import Model, new_model

try:
    __version__ = importlib.metadata.version("jaxspec")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ENGINES",
    "CheckpointError",
    "DeviceError",
    "DraftError",
    "GenerationResult",
    "JaxspecError",
    "KernelConfig",
    "Model",
    "ModelConfig",
    "OptionError",
    "Piece",
    "PromptError",
    "Stream",
    "WorkerError",
    "convert",
    "generate",
    "load",
    "load_draft",
    "new_model",
    "stream",
    "tune_host",
]
