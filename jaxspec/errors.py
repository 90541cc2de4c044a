"""Errors a user can cause. Each message says what happened and what to do about it."""


class JaxspecError(Exception):
    """Base class of every error caused by bad input; the CLI prints it and exits with code 2."""


class CheckpointError(JaxspecError):
    """A checkpoint is missing, incomplete, corrupt or of an unsupported architecture."""


class PromptError(JaxspecError):
    """A prompt is empty, too long for the context, or holds token ids outside the vocabulary."""


class OptionError(JaxspecError):
    """A method, sampling value or engine option is unknown or out of range."""


class DraftError(JaxspecError):
    """A draft cannot serve this target (another vocabulary, another tokenizer, unknown kind)."""


class DeviceError(JaxspecError):
    """The requested device layout cannot be built on this machine."""


class WorkerError(JaxspecError):
    """A worker of an asynchronous engine failed; the message names the worker and the cause."""
