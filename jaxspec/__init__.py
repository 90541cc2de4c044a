"""jaxspec: lossless speculative decoding in JAX."""

from jaxspec.api import generate
from jaxspec.config import ModelConfig
from jaxspec.engines.base import GenerationResult
from jaxspec.errors import (
    CheckpointError,
    DeviceError,
    DraftError,
    JaxspecError,
    OptionError,
    PromptError,
    WorkerError,
)
from jaxspec.io.convert import convert, load
from jaxspec.model.transformer import Model, new_model
from jaxspec.train.distill import load_draft

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
