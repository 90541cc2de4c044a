"""HF safetensors folders and GGUF files -> Orbax checkpoints; Orbax checkpoints -> ``Model``.
The readers are ``jaxspec.io.hf`` and ``jaxspec.io.gguf``; this module writes and restores.

A converted checkpoint is a folder::

    config.json    ModelConfig.to_json(), the stored dtype and, for a quantized model,
                   "quantization": {"method": ..., "tensors": {path: format}}
    params/        Orbax checkpoint of the nested parameter dict (layer keys as strings); a
                   quantized weight is a dict of its codes, scales and mins
    tokenizer/     the tokenizer, saved with ``save_pretrained`` (absent if the source had none)

``convert`` writes it atomically: everything goes into a temporary folder beside ``dst`` that is
renamed into place at the end, and removed on any failure or Ctrl-C (see ``jaxspec.io.paths``).
``load`` restores the parameters straight into their final placement (one device, or
NamedShardings over a mesh).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, JaxspecError, OptionError
from jaxspec.io import fingerprint, restore
from jaxspec.io.gguf import GGUFSource
from jaxspec.io.hf import hf_reader, load_tokenizer
from jaxspec.io.paths import check_output_path, interrupts_held, temp_dir, writing_beside
from jaxspec.io.weights import hf_to_tree
from jaxspec.model import quantized as Q
from jaxspec.model.sharding import param_specs
from jaxspec.model.transformer import Model
from pallas_kernels import quant
from pallas_kernels.quant import QuantizedWeight

PathLike = str | os.PathLike


# ----------------------------------------------------------------------------- convert


QUANTIZE = ("source", "none", "int8", "int4")
INT4_GROUP = 128  # gpt-fast's and AWQ's default group size


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    dtype: str | type | np.dtype = "bfloat16",
    quantize: str | None = "source",
    group_size: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    tokenizer: bool = True,
) -> pathlib.Path:
    """Convert an HF folder (safetensors) or a ``.gguf`` file into an Orbax checkpoint at ``dst``.

    ``dtype`` is the stored dtype of float parameters and the compute dtype of quantized ones.
    ``quantize``: ``"source"`` (default) keeps the source's quantization: GGUF Q8_0 / Q4_0 /
    Q4_1 blocks and AWQ weights stay quantized (other GGUF types are dequantized, with a note
    saying so); ``"none"`` (or None) dequantizes everything; ``"int8"`` quantizes the
    projections and LM head (the source's weights, dequantized first if they are quantized)
    symmetrically, a scale per output channel (or per ``group_size`` input rows); ``"int4"``
    the same in groups of ``group_size`` rows (default 128), which must divide every layer's
    input width (else ``OptionError``). ``overwrite`` replaces an existing ``dst`` that is a
    jaxspec checkpoint or draft (nothing else: not the source, not a folder holding it, not a
    folder with other files), by an atomic swap once the new checkpoint is complete.
    ``tokenizer=False`` skips the tokenizer.
    Returns the absolute path of the checkpoint.
    """
    src = pathlib.Path(src).expanduser()
    dst = pathlib.Path(dst).expanduser().absolute()
    np_dtype = _np_dtype(dtype)
    quantize, group_size = _quantize_option(quantize, group_size)
    if not src.exists():
        raise CheckpointError(
            f"no checkpoint at {src}; give an HF model folder (config.json + *.safetensors) "
            "or a .gguf file."
        )
    check_destination(src, dst, overwrite=overwrite)
    if src.is_dir():
        reader = hf_reader(src)
    elif src.suffix.lower() == ".gguf":
        reader = GGUFSource(src)
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
        keep = quantize == "source"
        with bar:
            tensors = _counted(reader.tensors(cfg, keep=keep), bar, check)
            tree = hf_to_tree(
                tensors, cfg, np_dtype, _quantizer(quantize, group_size, cfg, np_dtype)
            )
        if keep and getattr(reader, "dequantized", None):
            _note_dequantized(src, reader.dequantized, np_dtype)
        tok = reader.tokenizer() if tokenizer else None
        check()
        fmts = Q.formats(tree)
        _save_params(tmp / "params", Q.storable(tree))
        del tree
        # ModelConfig's fields plus the stored dtype (ModelConfig.from_json ignores extra keys)
        meta = {**json.loads(cfg.to_json()), "dtype": np_dtype.name}
        if fmts:
            method = quantize if quantize != "source" else ("awq" if src.is_dir() else "gguf")
            meta["quantization"] = {"method": method, "tensors": fmts}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        if tok is not None:
            tok.save_pretrained(str(tmp / "tokenizer"))
        check()
        _move_into_place(tmp, dst)
    return dst


def _quantize_option(quantize, group_size) -> tuple[str, int | None]:
    quantize = "none" if quantize is None else quantize
    if quantize not in QUANTIZE:
        raise OptionError(f"quantize must be one of {', '.join(QUANTIZE)}; got {quantize!r}.")
    if group_size is not None:
        if quantize not in ("int8", "int4"):
            raise OptionError(
                f"group_size applies to quantize='int8' or 'int4', not {quantize!r}; drop it or "
                "choose int8 / int4."
            )
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise OptionError(f"group_size must be an integer >= 2, got {group_size!r}.")
    if quantize == "int4" and group_size is None:
        group_size = INT4_GROUP
    return quantize, group_size


def _quantizer(quantize: str, group: int | None, cfg: ModelConfig, dtype=None):
    """``hf_to_tree``'s ``quantize`` hook for ``int8`` / ``int4`` (None otherwise). Scales are
    kept in the stored dtype when it has 16 bits (bf16 / f16: ``q * s`` is exact in float32, and
    they are half the bytes a step reads), else float32."""
    if quantize not in ("int8", "int4"):
        return None
    bits = int(quantize[3:])
    scale_dtype = jnp.float32
    if dtype is not None and jnp.dtype(dtype).itemsize == 2:
        scale_dtype = jnp.dtype(dtype)

    def one(path: tuple, arr: np.ndarray):
        if not Q.quantizable(path, cfg):
            return arr
        name, transpose = Q.path_name(path), path == Q.EMBEDDING
        w = Q.quantize_array(
            name, np.asarray(arr, np.float32), bits, group, transpose, scale_dtype=scale_dtype
        )
        return jax.tree.map(np.asarray, w)  # host arrays, as the rest of the tree

    return one


def _note_dequantized(src: pathlib.Path, kinds, dtype: np.dtype) -> None:
    what = ", ".join(f"{n} in {k}" for k, n in sorted(kinds.items()))
    print(
        f"note: {src.name}: {what} tensor(s) dequantized to {dtype.name}: jaxspec keeps Q8_0, "
        "Q4_0 and Q4_1 blocks quantized, and no other type.",
        file=sys.stderr,
    )


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


# ----------------------------------------------------------------------------- load


# Whether ``load`` keeps a quantized checkpoint's weights quantized, by backend (else it
# dequantizes them once, to the load's dtype), as measured:
# CPU: the real SmolLM2-135M Q4_1, autoregressive, B=1, 64 tokens, on the quiet 2-core CPU
# (benchmarks/results/quantized.json, section "cpu", commit 05f397c): 54.4 tok/s kept quantized
# against 61.8 dequantized to float32 (the CPU's default dtype), 57.4 against 56.0 in bfloat16.
# GPU, "wgmma": kept where Hopper's WGMMA kernel takes the weights (quantized.wgmma_takes: one
# device, an sm_90 GPU, bf16/f16 compute, layers outside the fused split-K path, symmetric
# codes in whole K steps): a Llama-3-8B-shape step at 4K 4.17 ms int8 and 3.32 ms int4 against
# 6.17 ms bf16 (one H100, section "gpu", 262aa69); elsewhere dequantized: the real SmolLM2 Q4_1
# (Triton's dequantizing kernels) decoded 989 tok/s kept against 1691 dequantized to bf16.
KEEP_QUANTIZED = {"cpu": False, "gpu": "wgmma"}


def load(
    path: PathLike,
    *,
    dtype: str | type | np.dtype | None = None,
    mesh: Mesh | None = None,
    quantized: bool | None = None,
) -> Model:
    """Load a converted checkpoint: onto the default device, or sharded over ``mesh``.

    With a mesh, attention heads, the MLP width and the vocabulary are split over its ``"tp"``
    axis (see ``jaxspec.model.sharding``, which lays out quantized weights too); every array is
    restored directly into its shards, and a mesh over several processes' devices has each
    process read only its own. In a distributed job every process calls ``load`` alike; a
    process given another checkpoint is a ``CheckpointError`` in all of them
    (``jaxspec.io.fingerprint``). ``dtype`` casts the float parameters and is the compute dtype
    of quantized ones (default: the stored dtype). ``quantized``: keep a quantized
    checkpoint's weights quantized (True) or dequantize them once, here (False); None: this
    backend's ``KEEP_QUANTIZED`` (on a GPU: kept where Hopper's WGMMA kernel takes them). Kept on
    one Hopper GPU, the weights that kernel takes are laid out for it (``Q.for_wgmma``).
    """
    path = pathlib.Path(path).expanduser().absolute()
    cfg, stored, fmts = _read_checkpoint(path)
    fingerprint.agree_files(path)
    params_dir = path / "params"
    dtype = stored if dtype is None else dtype
    jdtype = None if dtype is None else jnp.dtype(_np_dtype(dtype))
    try:
        with restore.checkpointer(mesh) as ckptr:
            if jdtype is None:  # an old checkpoint without its dtype: its first leaf's
                meta = ckptr.metadata(params_dir)
                meta = getattr(meta, "item_metadata", meta)
                jdtype = jnp.dtype(jax.tree.leaves(getattr(meta, "tree", meta))[0].dtype)
            graphdef, state = Q.abstract_params(cfg, jdtype, fmts)
            template = _template(nnx.to_pure_dict(state), cfg, jdtype, mesh)
            restored = restore.restore(ckptr, params_dir, _str_keys(Q.storable(template)), mesh)
    except JaxspecError:  # a mesh that does not fit the model (DeviceError): said as it is
        raise
    except Exception as e:  # Orbax / tensorstore raise ValueError, FileNotFoundError, ...
        raise _corrupt(params_dir, e) from None
    pure = Q.from_storable(_int_keys(restored), template)
    keep = KEEP_QUANTIZED.get(jax.default_backend(), True) if quantized is None else quantized
    if keep == "wgmma":
        keep = mesh is None and Q.wgmma_takes(cfg, jdtype, fmts)
    if fmts and not keep:
        pure = Q.dequantize_params(pure, jdtype)
        if mesh is not None:  # laid out as the float model is
            pure = jax.device_put(pure, param_specs(cfg, mesh))
    nnx.replace_by_pure_dict(state, pure)
    fingerprint.agree_weights(path, state)
    tok = None
    if (path / "tokenizer").is_dir():
        tok = load_tokenizer(str(path / "tokenizer"))
    model = Model(cfg, graphdef, state, tok, name=path.name)
    # kept quantized on one Hopper GPU: the WGMMA kernel's K-major layout, laid out once here
    return Q.for_wgmma(model) if fmts and keep and mesh is None else model


def _read_checkpoint(path: pathlib.Path) -> tuple[ModelConfig, str | None, dict]:
    """(config, stored dtype, quantized formats) of the checkpoint folder ``path``, or the
    CheckpointError that says what it is instead and what to do."""
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
        meta = json.loads(text)
        fmts = dict((meta.get("quantization") or {}).get("tensors") or {})
        bad = [name for name, f in fmts.items() if not {"bits", "group", "scales"} <= set(f)]
        if bad:
            raise KeyError(f"the quantization format of {bad[0]} is incomplete")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(
            f"{path / 'config.json'} is not a valid jaxspec config ({e}); convert the model again."
        ) from None
    if not (path / "params").is_dir():
        raise CheckpointError(
            f"{path} has no params/ folder; the conversion did not finish or the files were "
            "moved. Convert the model again."
        )
    return cfg, meta.get("dtype"), fmts


def _template(pure: dict, cfg: ModelConfig, dtype, mesh: Mesh | None) -> dict:
    """The restore template: every parameter of the abstract nested dict ``pure`` as a
    ``jax.ShapeDtypeStruct`` with its final sharding (float ones in ``dtype``; a quantized
    weight's codes, scales and mins in their stored dtypes)."""
    if mesh is None:  # in a distributed job: a whole copy in each process, on its first device
        device = SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, pure)
    else:
        shardings = param_specs(cfg, mesh, pure)

    def one(x, sharding):
        if not quant.is_quantized(x):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)
        mins = None if x.mins is None else x.mins.dtype
        return QuantizedWeight.abstract(
            x.bits, x.group, dtype, *x.shape, x.scales.dtype, mins, sharding=sharding
        )

    return jax.tree.map(one, pure, shardings, is_leaf=quant.is_quantized)


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
