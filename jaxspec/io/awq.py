"""AWQ checkpoints (HF safetensors in AutoAWQ's GEMM format) read as ``QuantizedWeight``s.

The format, as AutoAWQ writes it (the public reference followed here: casper-hansen/AutoAWQ,
``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``). A linear of ``in`` inputs and
``out`` outputs becomes three tensors beside each other (``<module>.qweight``, ...):

- ``qweight`` int32 ``[in, out / 8]``: eight 4-bit codes a word, along ``out``; word column
  ``c`` holds output column ``8c + ORDER[i]`` in bits ``[4i, 4i + 4)``,
  ``ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
- ``qzeros`` int32 ``[in / G, out / 8]``: the zero points, packed the same way;
- ``scales`` float16 ``[in / G, out]``;

and ``w[i, o] = (q[i, o] - z[i // G, o]) * s[i // G, o]`` with ``G`` the config's
``quantization_config.group_size`` (-1: all of ``in``). As a ``QuantizedWeight`` that is
``q * s + m`` with ``m = -z * s``, exact in float32 (a 4-bit integer times a float16), so the
dequantized weights are AutoAWQ's own to the bit when computed in float32.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxspec.errors import CheckpointError
from pallas_kernels import quant
from pallas_kernels.quant import QuantizedWeight

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PARTS = ("qweight", "qzeros", "scales")


def group_size(qc: dict, where) -> int | None:
    """The group size of an AWQ ``quantization_config`` (``None``: all of a weight's inputs);
    a CheckpointError for a quantization jaxspec does not read."""
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise CheckpointError(
            f"{where} is quantized with {method or 'an unnamed method'!r}; jaxspec reads AWQ "
            "(GEMM) checkpoints and float ones. Use the model's float or AWQ release."
        )
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    zero = qc.get("zero_point", True)
    if bits != 4 or version != "gemm" or not zero:
        raise CheckpointError(
            f"{where} is AWQ with bits={bits}, version={version!r}, zero_point={zero}; jaxspec "
            "reads 4-bit AWQ in the GEMM layout with zero points (AutoAWQ's default). Use such "
            "a release, or the float model."
        )
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return None if group == -1 else group


def unpack(words: np.ndarray) -> np.ndarray:
    """int32 words ``[r, c]`` as their 4-bit codes ``[r, 8c]`` (uint8) in column order."""
    r, c = words.shape
    nibbles = (words.view(np.uint32)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    codes = np.empty_like(nibbles)
    codes[:, :, list(ORDER)] = nibbles  # nibble i is column 8c + ORDER[i]
    return codes.reshape(r, 8 * c).astype(np.uint8)


def weight(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int | None):
    """One AWQ linear as a ``QuantizedWeight`` ``[in, out]``."""
    codes = unpack(qweight)
    k = codes.shape[0]
    group = group or k
    zeros = unpack(qzeros).astype(np.float32)
    s = np.asarray(scales)
    want = (k // group, codes.shape[1])
    if quant.group_problem(4, group, k) or zeros.shape != want or s.shape != want:
        raise ValueError(
            f"qweight {qweight.shape}, qzeros {qzeros.shape} and scales {s.shape} are not one "
            f"AWQ weight in groups of {group}"
        )
    mins = -(zeros * s.astype(np.float32))
    return QuantizedWeight(quant.pack4(codes, group), s, mins, 4, group, "float32")


def tensors(
    pairs: Iterator[tuple[str, np.ndarray]], group: int | None, keep: bool
) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """``pairs`` (HF name, array) with each AWQ module's three tensors joined into
    ``<module>.weight``: a ``QuantizedWeight`` (``keep``) or its dequantized float32 weight in
    HF's ``[out, in]`` orientation. Other tensors pass through."""
    pending: dict[str, dict] = {}
    for name, arr in pairs:
        module, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, arr
            continue
        parts = pending.setdefault(module, {})
        parts[part] = arr
        if len(parts) < len(PARTS):
            continue
        del pending[module]
        try:
            w = weight(parts["qweight"], parts["qzeros"], parts["scales"], group)
        except ValueError as e:
            raise CheckpointError(
                f"{module}: {e}; the checkpoint is corrupt or its config.json's "
                "quantization_config does not match its weights."
            ) from None
        yield f"{module}.weight", w if keep else np.asarray(quant.dequantize(w, np.float32)).T
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(set(PARTS) - set(parts))
        raise CheckpointError(
            f"the AWQ module {module} lacks {', '.join(missing)}; the checkpoint is incomplete. "
            "Re-download it."
        )
