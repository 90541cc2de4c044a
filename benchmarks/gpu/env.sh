# Sourced by the GPU session scripts: NVLink multicast stays off; our code and carried wheels.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=".:$HOME/site" XLA_PYTHON_CLIENT_PREALLOCATE=false
# The commit under test: git-ignored files do not travel to the GPU machine and its copy of .git
# can be stale, so write it into a carried folder before the call:
#   git rev-parse --short HEAD > .carry1/commit   (and name .carry1 in carry)
# A later call of the same warm machine finds it in the home folder.
c=$(cat .carry*/commit 2>/dev/null | head -n 1)
[ -n "$c" ] && echo "$c" > ~/.jaxspec_commit
export JAXSPEC_COMMIT="${c:-$(cat ~/.jaxspec_commit 2>/dev/null || echo unknown)}"
