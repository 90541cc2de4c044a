# Sourced by the GPU session scripts: NVLink multicast stays off; our code and carried wheels.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=".:$HOME/site" XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXSPEC_COMMIT="$(cat .commit 2>/dev/null || echo unknown)"
