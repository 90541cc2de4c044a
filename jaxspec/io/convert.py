"""HF safetensors folders and GGUF files -> Orbax checkpoints; Orbax checkpoints -> ``Model``.

A converted checkpoint is a folder::

    config.json    ModelConfig.to_json()
    params/        Orbax checkpoint of the nested parameter dict (layer keys as strings)
    tokenizer/     the tokenizer, saved with ``save_pretrained`` (absent if the source had none)

``convert`` writes it atomically: everything goes into a temporary folder beside ``dst`` that is
renamed into place at the end, and removed on any failure or Ctrl-C (see ``jaxspec.io.paths``).
``load`` restores the parameters straight into their final placement (one device, or
NamedShardings over a mesh).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import struct
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError
from jaxspec.io.paths import check_output_path, interrupts_held, temp_dir, writing_beside
from jaxspec.io.weights import hf_to_tree
from jaxspec.model.transformer import Model, abstract_model

PathLike = str | os.PathLike

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


# ----------------------------------------------------------------------------- convert


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    dtype: str | type | np.dtype = "bfloat16",
    progress: bool = True,
    overwrite: bool = False,
    tokenizer: bool = True,
) -> pathlib.Path:
    """Convert an HF folder (safetensors) or a ``.gguf`` file into an Orbax checkpoint at ``dst``.

    ``dtype`` is the stored parameter dtype. ``overwrite`` replaces an existing ``dst`` that is
    a jaxspec checkpoint or draft (nothing else: not the source, not a folder holding it, not a
    folder with other files), by an atomic swap once the new checkpoint is complete.
    ``tokenizer=False`` skips the tokenizer.
    Returns the absolute path of the checkpoint.
    """
    src = pathlib.Path(src).expanduser()
    dst = pathlib.Path(dst).expanduser().absolute()
    np_dtype = _np_dtype(dtype)
    if not src.exists():
        raise CheckpointError(
            f"no checkpoint at {src}; give an HF model folder (config.json + *.safetensors) "
            "or a .gguf file."
        )
    check_destination(src, dst, overwrite=overwrite)
    if src.is_dir():
        reader = _hf_reader(src)
    elif src.suffix.lower() == ".gguf":
        reader = _GGUFSource(src)
    else:
        raise CheckpointError(
            f"{src} is neither a folder nor a .gguf file; give an HF model folder "
            "(config.json + *.safetensors) or a .gguf file."
        )

    with writing_beside(dst) as (tmp, check):
        cfg = reader.config()
        check()
        bar = tqdm(
            total=reader.num_tensors(),
            desc=f"converting {src.name}",
            unit="tensor",
            disable=not progress,
        )
        with bar:
            tree = hf_to_tree(_counted(reader.tensors(cfg), bar, check), cfg, np_dtype)
        tok = reader.tokenizer() if tokenizer else None
        check()
        _save_params(tmp / "params", tree)
        del tree
        # ModelConfig's fields plus the stored dtype (ModelConfig.from_json ignores extra keys)
        meta = {**json.loads(cfg.to_json()), "dtype": np_dtype.name}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        if tok is not None:
            tok.save_pretrained(str(tmp / "tokenizer"))
        check()
        _move_into_place(tmp, dst)
    return dst


# What a folder written by ``convert`` (or by ``distill``, a draft) may hold: ``--overwrite``
# replaces only such a folder, so that nothing else a user keeps there is ever deleted.
CHECKPOINT_ENTRIES = frozenset({"config.json", "params", "tokenizer"})
DRAFT_ENTRIES = frozenset({"draft.json", "params"})


def checkpoint_kind(path: pathlib.Path) -> str | None:
    """'checkpoint' or 'draft' when ``path`` is a folder that jaxspec wrote and holds nothing
    else, else None. A checkpoint's config.json is a ModelConfig's (an HF folder's is not)."""
    if not path.is_dir():
        return None
    names = {p.name for p in path.iterdir()}
    if not (path / "params").is_dir():
        return None
    if names <= CHECKPOINT_ENTRIES and "config.json" in names:
        try:
            meta = json.loads((path / "config.json").read_text())
            ModelConfig.from_json(json.dumps(meta))
        except (ValueError, TypeError, KeyError, AttributeError, CheckpointError):
            return None
        return "checkpoint" if "dtype" in meta and "family" in meta else None
    if names <= DRAFT_ENTRIES and "draft.json" in names:
        try:
            meta = json.loads((path / "draft.json").read_text())
        except ValueError:
            return None
        return "draft" if str(meta.get("format", "")).startswith("jaxspec-draft/") else None
    return None


def check_destination(src: pathlib.Path, dst: pathlib.Path, *, overwrite: bool) -> None:
    """Refuse, before any work, a destination that would lose data: the source itself, a
    folder holding the source, a non-empty folder without ``overwrite``, and with it anything
    but a jaxspec checkpoint or draft. A destination under a file is refused too."""
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src or real_dst in real_src.parents:
        what = "is the source" if real_dst == real_src else "holds the source"
        raise CheckpointError(
            f"the destination {dst} {what} ({src}); writing there would destroy the source. "
            "Choose a destination outside it."
        )
    check_output_path(dst, "destination", folder=True, error=CheckpointError)
    if not real_dst.is_dir() or not any(real_dst.iterdir()):
        return
    if not overwrite:
        raise CheckpointError(
            f"{dst} already exists and is not empty; pass overwrite=True (CLI: --overwrite) "
            "to replace it, or choose another destination."
        )
    if checkpoint_kind(real_dst) is None:
        raise CheckpointError(
            f"{dst} is not a jaxspec checkpoint or draft (it holds "
            f"{', '.join(sorted(p.name for p in real_dst.iterdir())[:5])}), so --overwrite will "
            "not replace it: it replaces only a folder that jaxspec wrote. Choose another "
            "destination, or move that folder away yourself."
        )


def _counted(items: Iterator, bar, check) -> Iterator:
    # A plain generator (not the tqdm object itself): runtime type checkers sample reiterable
    # containers such as tqdm by iterating them, which would drain a one-shot tensor stream.
    for item in items:
        check()  # a held Ctrl-C stops the convert between tensors
        yield item
        bar.update(1)


def _np_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise CheckpointError(f"unknown dtype {dtype!r}; use 'bfloat16', 'float16' or 'float32'.")
    return dt


def _save_params(path: pathlib.Path, tree: dict) -> None:
    """Write ``tree`` as an Orbax checkpoint; a Ctrl-C waits for the write to end (see
    ``interrupts_held``), so that the caller's cleanup has nothing left to race."""
    import orbax.checkpoint as ocp

    with interrupts_held(), ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _str_keys(tree))
        ckptr.wait_until_finished()


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot, and the caller falls back to two renames."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _move_into_place(tmp: pathlib.Path, dst: pathlib.Path) -> None:
    """Put the finished checkpoint ``tmp`` at ``dst``: a rename, or, over an old checkpoint, an
    atomic exchange of the two folders (the old one is then deleted from ``tmp``'s place)."""
    if not dst.exists() or (dst.is_dir() and not any(dst.iterdir())):
        os.replace(tmp, dst)
        return
    if _exchange(tmp, dst):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
        return
    # two renames: a Ctrl-C between them would leave no checkpoint at dst
    with interrupts_held():
        old = temp_dir(dst, "old")
        os.replace(dst, old / "ckpt")
        try:
            os.replace(tmp, dst)
        except BaseException:
            os.replace(old / "ckpt", dst)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)


def _str_keys(tree):
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _int_keys(tree):
    if isinstance(tree, dict):
        return {
            (int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v)
            for k, v in tree.items()
        }
    return tree


# ----------------------------------------------------------------------------- HF safetensors

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


def _hf_reader(folder: pathlib.Path) -> _HFSource:
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder} has no config.json, so it is not an HF model folder; give the folder that "
            "holds config.json and the *.safetensors weights (or a .gguf file)."
        )
    return _HFSource(folder, _safetensors_files(folder))


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


class _HFSource:
    def __init__(self, folder: pathlib.Path, files: list[pathlib.Path]):
        self.folder = folder
        self.files = [_SafetensorsFile(p) for p in files]

    def config(self) -> ModelConfig:
        try:
            hf = json.loads((self.folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{self.folder / 'config.json'} is not valid JSON ({e}); re-download it."
            ) from None
        if not isinstance(hf, dict):
            raise CheckpointError(f"{self.folder / 'config.json'} is not a JSON object.")
        return ModelConfig.from_hf(hf)

    def num_tensors(self) -> int:
        return sum(len(f.entries) for f in self.files)

    def tensors(self, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
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
        return _load_tokenizer(str(self.folder))


# tokenizer classes that are transformers' plain fast tokenizer (as jaxspec saves a GGUF's)
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(folder: str, **kwargs):
    try:
        if not kwargs and _plain_fast(pathlib.Path(folder)):
            # AutoTokenizer imports torch (3 s of a 5 s warm start on 2 cores); the plain fast
            # class loads the same tokenizer without it
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except Exception as e:  # transformers raises many kinds
        where = f"{folder}/{kwargs['gguf_file']}" if "gguf_file" in kwargs else folder
        raise CheckpointError(
            f"the tokenizer in {where} could not be loaded ({type(e).__name__}: {e}); fix or "
            "remove its tokenizer files, or convert without it (tokenizer=False)."
        ) from None


def _plain_fast(folder: pathlib.Path) -> bool:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / "tokenizer.json").is_file() and config.get("tokenizer_class") in _PLAIN_FAST


# ----------------------------------------------------------------------------- GGUF

# llama.cpp tensor names -> HF names ({i}: layer).
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF general.architecture -> (jaxspec family, whether llama.cpp permuted the q/k rows).
_GGUF_ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k weight (or bias).

    llama.cpp's converter (``LlamaModel.permute``) reorders each head's rows from HF's
    rotate-half layout (pairs (j, j + hd/2)) to interleaved pairs (2j, 2j+1)::

        w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)

    This is its inverse (as transformers' ``LlamaTensorProcessor``): ``n_head`` is the number
    of query heads for q and of key/value heads for k.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _GGUFSource:
    def __init__(self, path: pathlib.Path):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
            self.by_name = {t.name: t for t in self.reader.tensors}
        except Exception as e:  # gguf raises ValueError, struct errors, IndexError, ...
            raise CheckpointError(
                f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is corrupt "
                "or truncated. Re-download it."
            ) from None
        arch = self._field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise CheckpointError(
                f"unsupported GGUF architecture {arch!r}; jaxspec converts GGUF architectures "
                f"{', '.join(sorted(_GGUF_ARCHS))} (Llama 2/3, Mistral, SmolLM2, Qwen2)."
            )
        self.arch = arch
        self.family, self.permuted = _GGUF_ARCHS[arch]

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: metadata {key} is unreadable ({e}); the file is corrupt."
            ) from None

    def _need(self, key: str):
        value = self._field(f"{self.arch}.{key}")
        if value is None:
            raise CheckpointError(
                f"{self.path} lacks the metadata {self.arch}.{key}; it is not a complete "
                f"{self.arch} GGUF."
            )
        return value

    def config(self) -> ModelConfig:
        heads = int(self._need("attention.head_count"))
        hidden = int(self._need("embedding_length"))
        head_dim = int(self._field(f"{self.arch}.attention.key_length") or hidden // heads)
        rope_dim = self._field(f"{self.arch}.rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != head_dim:
            raise CheckpointError(
                f"{self.path}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
                f"head_dim={head_dim}) are not supported."
            )
        scaling_type = self._field(f"{self.arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            raise CheckpointError(
                f"{self.path}: RoPE scaling {scaling_type!r} is not supported; jaxspec supports "
                "'llama3' scaling and none."
            )
        theta = float(self._field(f"{self.arch}.rope.freq_base") or 10000.0)
        emb = self.by_name.get("token_embd.weight")
        if emb is None:
            raise CheckpointError(f"{self.path} lacks token_embd.weight; the file is incomplete.")
        vocab = int(emb.shape[-1])  # ggml order: [hidden, vocab]
        rope_scaling = None
        freqs = self.by_name.get("rope_freqs.weight")
        if freqs is not None:
            rope_scaling = llama3_scaling_from_rope_freqs(
                np.asarray(self._dequantize(freqs), np.float64), theta, head_dim
            )
        eos = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            v = self._field(f"tokenizer.ggml.{key}")
            if v is not None and int(v) not in eos:
                eos.append(int(v))
        bos = self._field("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._need("feed_forward_length")),
            num_layers=int(self._need("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(f"{self.arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            max_position_embeddings=int(self._field(f"{self.arch}.context_length") or 4096),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(self._need("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.by_name,
            qkv_bias=self.family == "qwen2" or "blk.0.attn_q.bias" in self.by_name,
            family=self.family,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
        )

    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def _dequantize(self, t) -> np.ndarray:
        from gguf import quants

        try:
            return quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {t.name} uses the quantization {t.tensor_type.name}, "
                "which the gguf package cannot dequantize; use another quantization."
            ) from None
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: tensor {t.name} is unreadable ({type(e).__name__}: {e}); the "
                "file is corrupt or truncated."
            ) from None

    def tensors(self, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            arr = self._dequantize(t)
            if self.permuted and (".attn_q." in t.name or ".attn_k." in t.name):
                n = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
                if arr.shape[0] % (2 * n):
                    raise CheckpointError(
                        f"{self.path}: tensor {t.name} has {arr.shape[0]} rows, not a multiple "
                        f"of 2 x {n} heads; the file does not match its metadata."
                    )
                arr = unpermute_qk(arr, n)
            yield name, arr

    def tokenizer(self):
        if "tokenizer.ggml.tokens" not in self.reader.fields:
            return None
        try:
            return self._tokenizer_without_torch()
        except ImportError:  # another transformers layout: its own loader (needs torch)
            return _load_tokenizer(str(self.path.parent), gguf_file=self.path.name)

    def _tokenizer_without_torch(self):
        """The tokenizer transformers builds from a GGUF, without its GGUF reader (which imports
        torch): the metadata comes from the ``gguf`` package, the construction is transformers'
        own ``convert_gguf_tokenizer``, so both spell the same tokenizer."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        def grouped(group):
            out = {}
            for key, name in GGUF_TOKENIZER_MAPPING[group].items():
                value = self._field(f"tokenizer.{key}")
                if value is not None:
                    out[name] = value
            return out

        tokenizer, config = grouped("tokenizer"), grouped("tokenizer_config")
        if tokenizer.get("tokenizer_type") == "llama":
            config.setdefault("add_bos_token", True)  # as transformers: older files lack it
        for name, key in _SPECIAL_TOKENS.items():
            token_id = self._field(f"tokenizer.ggml.{key}")
            config[name] = tokenizer["tokens"][int(token_id)] if token_id is not None else None
        try:
            fast, extra = convert_gguf_tokenizer(self.arch, tokenizer)
            return PreTrainedTokenizerFast(tokenizer_object=fast, **config, **extra)
        except ImportError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"the tokenizer in {self.path} could not be built ({type(e).__name__}: {e}); "
                "convert without it (tokenizer=False) and pass token ids."
            ) from None


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def llama3_scaling_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int) -> tuple:
    """Recover ModelConfig.rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores llama3 scaling as one divisor per frequency instead of its parameters.
    The scaling depends only on ``factor`` and the two wavelength bounds
    ``original_max_position_embeddings / low_freq_factor`` and ``... / high_freq_factor``;
    the parameters are recovered with ``low_freq_factor = 1`` (Meta's value) and checked by
    recomputing every divisor.
    """
    from jaxspec.config import rope_inv_freq

    factors = np.asarray(factors, np.float64).reshape(-1)
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if factors.shape != inv.shape:
        raise CheckpointError(
            f"rope_freqs has {factors.size} entries, expected {inv.size} (head_dim/2)."
        )
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    wl = 2 * math.pi / inv
    high_band = np.isclose(factors, 1.0, rtol=1e-5)
    low_band = np.isclose(factors, factor, rtol=1e-5)
    mid = ~(high_band | low_band)
    candidates = [(1.0, 4.0, 8192)]  # Meta's Llama 3.1 / 3.2 values
    # smooth s = (old / wl - low) / (high - low); with low = 1: s = (old / wl - 1) / (high - 1)
    s = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    if mid.sum() >= 2:
        a, b = np.polyfit(1.0 / wl[mid], s[mid], 1)  # s = a / wl + b; a = old/(h-1), b = -1/(h-1)
        if b < 0:
            high = 1.0 - 1.0 / b
            candidates.append((1.0, high, round(a * (high - 1.0))))
    elif mid.sum() == 1:
        w0, s0 = wl[mid][0], s[mid][0]
        for high in (4.0, 2.0, 8.0):
            candidates.append((1.0, high, round(w0 * (s0 * (high - 1.0) + 1.0))))
    else:
        lo = wl[high_band].max() if high_band.any() else 0.0  # every high-band wl < old / high
        hi = wl[low_band].min() if low_band.any() else np.inf  # every low-band wl > old / low
        for high in (4.0, 2.0, 8.0):
            if lo * high < hi:
                top = hi if np.isfinite(hi) else lo * high * 2 + 2
                candidates.append((1.0, high, round((lo * high + top) / 2)))
    for low, high, old in candidates:
        if old <= 0:
            continue
        rs = ("llama3", factor, low, high, int(old))
        probe = ModelConfig(
            vocab_size=1,
            hidden_size=head_dim,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rs,
        )
        if np.allclose(inv / rope_inv_freq(probe), factors, rtol=1e-4):
            return rs
    raise CheckpointError(
        "the GGUF's rope_freqs tensor does not match llama3 RoPE scaling; this RoPE scaling "
        "is not supported."
    )


# ----------------------------------------------------------------------------- load


def load(
    path: PathLike,
    *,
    dtype: str | type | np.dtype | None = None,
    mesh: Mesh | None = None,
) -> Model:
    """Load a converted checkpoint: onto the default device, or sharded over ``mesh``.

    With a mesh, attention heads, the MLP width and the vocabulary are split over its ``"tp"``
    axis (see ``jaxspec.model.sharding``); every array is restored directly into its shards.
    ``dtype`` casts the parameters (default: the stored dtype).
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).expanduser().absolute()
    if path.is_file() and path.suffix.lower() == ".gguf":
        raise _convert_first(path, "a GGUF file")
    if _is_hf_folder(path):
        raise _convert_first(path, "an HF model folder")
    if not path.is_dir():
        raise CheckpointError(
            f"no converted checkpoint at {path}; create one with jaxspec.convert(src, "
            f"{str(path)!r}) or `jaxspec convert SRC {path}`."
        )
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} has no config.json, so it is not a jaxspec checkpoint; convert the model "
            "with jaxspec.convert first (HF folders and .gguf files must be converted)."
        )
    try:
        text = (path / "config.json").read_text()
        cfg = ModelConfig.from_json(text)
        stored = json.loads(text).get("dtype")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(
            f"{path / 'config.json'} is not a valid jaxspec config ({e}); convert the model again."
        ) from None
    params_dir = path / "params"
    if not params_dir.is_dir():
        raise CheckpointError(
            f"{path} has no params/ folder; the conversion did not finish or the files were "
            "moved. Convert the model again."
        )
    if mesh is None:
        shardings = None
        device = SingleDeviceSharding(jax.devices()[0])
    else:
        from jaxspec.model.sharding import param_specs

        shardings = param_specs(cfg, mesh)
        device = None

    if dtype is None:
        dtype = stored
    jdtype = None if dtype is None else jnp.dtype(_np_dtype(dtype))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            if jdtype is None:
                meta = ckptr.metadata(params_dir)
                meta = getattr(meta, "item_metadata", meta)
                jdtype = jnp.dtype(jax.tree.leaves(getattr(meta, "tree", meta))[0].dtype)
            graphdef, state = abstract_model(cfg, jdtype)
            target = jax.tree_util.tree_map_with_path(
                lambda p, x: jax.ShapeDtypeStruct(
                    x.shape, jdtype, sharding=device if shardings is None else _at(shardings, p)
                ),
                nnx.to_pure_dict(state),
            )
            restored = ckptr.restore(params_dir, _str_keys(target))
    except Exception as e:  # Orbax / tensorstore raise ValueError, FileNotFoundError, ...
        raise _corrupt(params_dir, e) from None
    nnx.replace_by_pure_dict(state, _int_keys(restored))
    tok = None
    if (path / "tokenizer").is_dir():
        tok = _load_tokenizer(str(path / "tokenizer"))
    return Model(cfg, graphdef, state, tok, name=path.name)


def is_source(path: pathlib.Path) -> bool:
    """Whether ``path`` is a model ``convert`` takes (a .gguf file or an HF model folder) rather
    than a converted checkpoint."""
    return (path.is_file() and path.suffix.lower() == ".gguf") or _is_hf_folder(path)


def _is_hf_folder(path: pathlib.Path) -> bool:
    """An HF model folder: config.json beside safetensors weights (or an HF config: one with a
    model_type), and no params/ of a converted checkpoint."""
    if not (path / "config.json").is_file() or (path / "params").is_dir():
        return False
    if next(path.glob("*.safetensors"), None) is not None:
        return True
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _convert_first(src: pathlib.Path, what: str) -> CheckpointError:
    """The error for a model that ``load`` cannot read until it is converted, with the command
    that converts it (into a folder beside it)."""
    import shlex

    stem = src.with_suffix("") if src.is_file() else src
    dst = stem if stem != src and not stem.exists() else stem.with_name(stem.name + "-jaxspec")
    return CheckpointError(
        f"{src} is {what}, not a converted checkpoint; convert it first: jaxspec convert "
        f"{shlex.quote(str(src))} {shlex.quote(str(dst))} (Python: jaxspec.convert"
        f"({str(src)!r}, {str(dst)!r})), then load {dst}."
    )


def _corrupt(params_dir: pathlib.Path, e: Exception) -> CheckpointError:
    msg = str(e).splitlines()[0][:300] if str(e) else ""
    return CheckpointError(
        f"could not restore the parameters in {params_dir} ({type(e).__name__}: {msg}); the "
        "checkpoint is corrupt, incomplete or was written for another config. Convert the "
        "model again."
    )


def _at(tree, path):
    node = tree
    for k in path:
        node = node[getattr(k, "key", getattr(k, "idx", k))]
    return node
