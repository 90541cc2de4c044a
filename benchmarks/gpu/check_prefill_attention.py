"""The flash prefill kernel compiled on the GPU at the prefill's real sizes (T = 1024 and 4096
queries, SmolLM2 and Llama-3-8B heads, one causal chunk from an empty cache and one after a
prefix) against the jnp reference at full precision, with NaN in every unused cache slot (the
CPU tests' inputs: tests/test_kernels.make_inputs, tests/test_prefill_attention.causal_masks).

    python benchmarks/gpu/check_prefill_attention.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.prefill_attention import prefill_attention
from pallas_kernels.reference import attend
from tests.test_kernels import TOL, make_inputs
from tests.test_prefill_attention import causal_masks, with_mask

CASES = [  # (t, kh, g, hd, lengths, dtype)
    (1024, 3, 3, 64, [0], jnp.float32),
    (4096, 3, 3, 64, [0], jnp.float32),
    (4096, 3, 3, 64, [0], jnp.bfloat16),
    (1024, 3, 3, 64, [3072], jnp.bfloat16),
    (1024, 8, 4, 128, [0, 3000], jnp.bfloat16),
]


def main():
    assert jax.default_backend() == "gpu"
    for seed, (t, kh, g, hd, lengths, dtype) in enumerate(CASES):
        s = max(lengths) + t + 144
        kw = dict(b=len(lengths), t=t, kh=kh, g=g, s=s, n=t, lengths=lengths, dtype=dtype, hd=hd)
        poisoned, clean = make_inputs(seed, **kw)
        mask = causal_masks(len(lengths), t, t, [t] * len(lengths))
        poisoned, clean = with_mask(poisoned, mask), with_mask(clean, mask)
        got = np.asarray(prefill_attention(*poisoned).astype(jnp.float32))
        with jax.default_matmul_precision("highest"):
            want = np.asarray(
                attend(*(x.astype(jnp.float32) if x.dtype == dtype else x for x in clean))
            )
        diff = float(np.abs(got - want).max())
        ok = np.isfinite(got).all() and diff <= TOL[dtype] * (1 + np.abs(want).max())
        print(
            "ok" if ok else "FAIL", t, kh, g, hd, lengths, jnp.dtype(dtype).name, "max diff", diff
        )


if __name__ == "__main__":
    main()
