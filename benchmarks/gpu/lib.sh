# Helpers of the runners (sourced after env.sh). `bash benchmarks/gpu/lib.sh stash` runs one.
GGUF="$HOME/smol.gguf"  # SmolLM2-135M-Instruct, joined from the two halves the calls carry
DRAFT=checkpoints/drafts/smollm2-135m-instruct-draft  # the shipped distilled draft
FEATURE=checkpoints/drafts/smollm2-135m-instruct-feature  # the shipped feature head

quiet() { grep -v "^W0000\|^I0000\|^E0000\|^\s*$"; }  # drop XLA's log lines and blank lines

bench() {  # NAME SECONDS COMMAND...: COMMAND under a time limit, its output also in $OUT/NAME.log
  local name=$1 seconds=$2
  shift 2
  : "${OUT:?set OUT to the output folder}"
  timeout "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.log" | quiet
  return "${PIPESTATUS[0]}"
}

gpus() { nvidia-smi -L 2>/dev/null | grep -c "^GPU"; }

stash() {  # call 1 of the GGUF transfer (carry .carry1 .whl): its first half, the gguf wheel,
  # and the PyTorch peer's script when carried (cp ../shared/peers/torch_cudagraph.py .carry1/)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/ || return 1
  if [ -f .carry1/torch_cudagraph.py ]; then mkdir -p ~/peer && cp .carry1/torch_cudagraph.py ~/peer/; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
}

use_gguf() {  # the GGUF for the default model: joined and checked in call 2 (carry .carry2)
  if [ ! -f "$GGUF" ]; then
    if [ ! -f ~/gguf/gguf.part00 ] || [ ! -f .carry2/gguf.part01 ]; then
      echo "no GGUF on this machine: see benchmarks/gpu/README.md (two calls)" >&2
      return 1
    fi
    cat ~/gguf/gguf.part00 .carry2/gguf.part01 > "$GGUF.part"
    if ! echo "$(cat .carry2/sha256)  $GGUF.part" | sha256sum -c --quiet; then
      rm "$GGUF.part"
      return 1
    fi
    mv "$GGUF.part" "$GGUF"
  fi
  export JAXSPEC_DEFAULT_GGUF="$GGUF"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then "$@"; fi
