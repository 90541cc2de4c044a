"""Test set-up: 8 forced host devices, CPU only, float32 matmuls, and jaxtyping's runtime shape
checks (beartype) on every jaxspec and pallas_kernels module."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib  # noqa: E402
import pkgutil  # noqa: E402

import jax  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

with install_import_hook(["jaxspec", "pallas_kernels"], "beartype.beartype"):
    for package in ("jaxspec", "pallas_kernels"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
            importlib.import_module(info.name)
