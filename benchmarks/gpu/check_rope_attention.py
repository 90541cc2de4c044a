"""The fused RoPE + cache write + attention kernel compiled on the GPU against its unfused
reference, with the CPU tests' inputs and checks (tests/test_rope_attention.py): poisoned cache
slots past the prefix, outputs within tolerance, new cache rows equal, other rows untouched.

    python benchmarks/gpu/check_rope_attention.py [--interpret]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from pallas_kernels import rope_attention as R
from tests.test_rope_attention import check, copies, make_inputs

CASES = [  # (b, t, kh, g, s, hd, dtype, tree): SmolLM2 and Llama-3-8B heads, decode and verifies
    (1, 1, 3, 3, 1100, 64, jnp.bfloat16, False),
    (1, 1, 3, 3, 4200, 64, jnp.float32, False),
    (128, 1, 3, 3, 530, 64, jnp.bfloat16, False),
    (1, 9, 3, 3, 1100, 64, jnp.bfloat16, False),
    (1, 9, 8, 4, 4200, 128, jnp.bfloat16, True),
    (4, 17, 8, 4, 333, 128, jnp.float32, True),
]


def main():
    interpret = "--interpret" in sys.argv  # a CPU check of this script: the first two cases
    assert interpret or jax.default_backend() == "gpu", "on CPU: --interpret"
    for seed, case in enumerate(CASES[:2] if interpret else CASES):
        b, t, kh, g, s, hd, dtype, tree = case
        kw = dict(b=b, t=t, kh=kh, g=g, s=s, hd=hd, dtype=dtype, tree=tree)
        poisoned, clean = make_inputs(seed, **kw)
        got = R.rope_attention(*copies(poisoned), num_heads=kh * g, interpret=interpret)
        # the kernel's float32 dots are IEEE (decode_attention._dot), XLA's default on a GPU is
        # TF32: the reference at full precision, or float32 cases differ by ~5e-5
        with jax.default_matmul_precision("highest"):
            want = R.reference(*clean, num_heads=kh * g)
        check(got, want, poisoned, dtype)
        print("ok", b, t, kh, g, s, hd, jnp.dtype(dtype).name, "tree" if tree else "causal")


if __name__ == "__main__":
    main()
