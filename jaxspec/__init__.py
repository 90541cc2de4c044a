"""jaxspec: lossless speculative decoding in JAX."""

from jaxspec.config import ModelConfig
from jaxspec.convert import convert, load
from jaxspec.errors import (
    CheckpointError,
    DeviceError,
    DraftError,
    JaxspecError,
    OptionError,
    PromptError,
    WorkerError,
)
from jaxspec.model import Model, new_model

__all__ = [
    "CheckpointError",
    "DeviceError",
    "DraftError",
    "JaxspecError",
    "Model",
    "ModelConfig",
    "OptionError",
    "PromptError",
    "WorkerError",
    "convert",
    "load",
    "new_model",
]
