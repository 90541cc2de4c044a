"""jaxspec: lossless speculative decoding in JAX."""

from jaxspec.config import ModelConfig
from jaxspec.convert import convert, load
from jaxspec.distill import load_draft
from jaxspec.engines.common import GenerationResult
from jaxspec.errors import (
    CheckpointError,
    DeviceError,
    DraftError,
    JaxspecError,
    OptionError,
    PromptError,
    WorkerError,
)
from jaxspec.generate import generate
from jaxspec.model import Model, new_model

__all__ = [
    "CheckpointError",
    "DeviceError",
    "DraftError",
    "GenerationResult",
    "JaxspecError",
    "Model",
    "ModelConfig",
    "OptionError",
    "PromptError",
    "WorkerError",
    "convert",
    "generate",
    "load",
    "load_draft",
    "new_model",
]
