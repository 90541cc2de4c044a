# Sourced by every runner: NVLink multicast stays off; our code and the carried wheels on the path.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=".:$HOME/site" XLA_PYTHON_CLIENT_PREALLOCATE=false
# The commit under test, for the JSONs' metadata: the GPU machine's copy of .git can be stale, so
# the first call of a machine carries it (git rev-parse --short HEAD > .carry1/commit); later
# calls on the same warm machine find it in the home folder. The newest carried file wins: a
# warm machine keeps the folders of earlier calls (.carry1 of the first GGUF call beside this
# call's .carry2), and by name the stale one came first (2026-12-07: a run recorded the commit
# of two calls before).
c=$(ls -t .carry*/commit 2>/dev/null | head -n 1 | xargs -r cat)
[ -n "$c" ] && echo "$c" > ~/.jaxspec_commit
export JAXSPEC_COMMIT="${c:-$(cat ~/.jaxspec_commit 2>/dev/null || echo unknown)}"
