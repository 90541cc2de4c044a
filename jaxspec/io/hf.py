"""HF model folders: the safetensors reader (memory-mapped, validated up front), AWQ weights
(``jaxspec.io.awq``) and the tokenizer beside the weights."""

from __future__ import annotations

import functools
import json
import math
import pathlib
import struct
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError
from jaxspec.io import awq, tokenizer
from pallas_kernels.quant import QuantizedWeight

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jnp.bfloat16,
    "F8_E4M3": jnp.float8_e4m3fn,
    "F8_E5M2": jnp.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def hf_reader(folder: pathlib.Path) -> HFSource:
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder} has no config.json, so it is not an HF model folder; give the folder that "
            "holds config.json and the *.safetensors weights (or a .gguf file)."
        )
    return HFSource(folder, _safetensors_files(folder))


def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index} is not a valid safetensors index ({e}); re-download the checkpoint."
            ) from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{folder} lacks the shard {missing[0]} named in model.safetensors.index.json "
                f"({len(missing)} of {len(names)} shards missing); re-download the checkpoint."
            )
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("model*.safetensors")) or sorted(
        p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated")
    )
    if not files:
        raise CheckpointError(
            f"{folder} has config.json but no *.safetensors weights; jaxspec converts "
            "safetensors (re-save PyTorch .bin weights with save_pretrained(..., "
            "safe_serialization=True)) or .gguf files."
        )
    return files


class _SafetensorsFile:
    """A memory-mapped safetensors file, validated up front (header, dtypes, offsets)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("file shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file size {size}")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            header.pop("__metadata__", None)
            data_start, data_len = 8 + n, size - 8 - n
            self.entries = {}
            for name, info in header.items():
                dt = np.dtype(_ST_DTYPES[info["dtype"]])
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
                if not 0 <= begin <= end <= data_len:
                    raise ValueError(f"tensor {name} lies outside the file (truncated?)")
                if end - begin != math.prod(shape) * dt.itemsize:
                    raise ValueError(f"tensor {name} has {end - begin} bytes for shape {shape}")
                self.entries[name] = (dt, shape, data_start + begin)
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path} is not a valid safetensors file ({e}); it is corrupt or truncated. "
                "Re-download or re-export the checkpoint."
            ) from None
        self._mm = None

    def get(self, name: str) -> np.ndarray:
        dt, shape, offset = self.entries[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, dt)
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        nbytes = math.prod(shape) * dt.itemsize
        return self._mm[offset : offset + nbytes].view(dt).reshape(shape)


class HFSource:
    def __init__(self, folder: pathlib.Path, files: list[pathlib.Path]):
        self.folder = folder
        self.files = [_SafetensorsFile(p) for p in files]
        self.awq = False  # set by config(): whether the weights are AWQ
        self.group = None  # AWQ's group size (None: a weight's whole input)
        self.dequantized = {}

    def config(self) -> ModelConfig:
        where = self.folder / "config.json"
        try:
            hf = json.loads(where.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{where} is not valid JSON ({e}); re-download it.") from None
        if not isinstance(hf, dict):
            raise CheckpointError(f"{where} is not a JSON object.")
        qc = hf.get("quantization_config")
        if qc is not None:
            self.awq, self.group = True, awq.group_size(qc if isinstance(qc, dict) else {}, where)
        return ModelConfig.from_hf(hf)

    def num_tensors(self) -> int:
        return sum(len(f.entries) for f in self.files)

    def tensors(
        self, cfg: ModelConfig, keep: bool = False
    ) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        """(HF name, tensor) pairs; an AWQ module's three tensors as one weight: with ``keep`` a
        ``QuantizedWeight`` ``[in, out]``, else dequantized (HF's ``[out, in]``)."""
        pairs = self._arrays()
        return awq.tensors(pairs, self.group, keep) if self.awq else pairs

    def _arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        for f in self.files:
            for name in f.entries:
                try:
                    arr = f.get(name)
                except (OSError, ValueError) as e:
                    raise CheckpointError(
                        f"could not read tensor {name} from {f.path} ({e}); the file is corrupt."
                    ) from None
                yield name, arr

    def tokenizer(self):
        if not any((self.folder / n).is_file() for n in _TOKENIZER_FILES):
            return None
        return load_tokenizer(str(self.folder))


def load_tokenizer(folder: str, **kwargs):
    """The tokenizer in ``folder``: a plain fast one through ``jaxspec.io.tokenizer`` (no
    transformers import on the way to the first token), any other through transformers
    (``kwargs``: ``AutoTokenizer``'s, e.g. ``gguf_file``)."""
    try:
        if not kwargs and tokenizer.plain(pathlib.Path(folder)):
            return tokenizer.Tokenizer(folder, functools.partial(_fast, folder))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except Exception as e:  # transformers and tokenizers raise many kinds
        where = f"{folder}/{kwargs['gguf_file']}" if "gguf_file" in kwargs else folder
        raise CheckpointError(
            f"the tokenizer in {where} could not be loaded ({type(e).__name__}: {e}); fix or "
            "remove its tokenizer files, or convert without it (tokenizer=False)."
        ) from None


def _fast(folder: str):
    """transformers' tokenizer of a plain fast folder (AutoTokenizer imports torch: 3 s of a
    5 s warm start on 2 cores; the plain fast class loads the same tokenizer without it)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
