# Helpers of the runners (sourced after env.sh). `bash benchmarks/gpu/lib.sh stash` runs one.
GGUF="$HOME/smol.gguf"  # SmolLM2-135M-Instruct, joined from the parts the calls carry
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

stash() {  # a call before the runner's (carry .carry1 and .whl, then .carry1b ...): the GGUF
  # parts it carries (.carry1*/gguf.part*), the gguf wheel when carried, and the PyTorch peer's
  # script when carried (cp ../shared/peers/torch_cudagraph.py .carry1/)
  local parts=(.carry1*/gguf.part*)
  [ -e "${parts[0]}" ] || { echo "no GGUF part carried (.carry1*/gguf.part*)" >&2; return 1; }
  mkdir -p ~/gguf && cp "${parts[@]}" ~/gguf/ || return 1
  local peer=(.carry1*/torch_cudagraph.py)
  if [ -e "${peer[0]}" ]; then mkdir -p ~/peer && cp "${peer[0]}" ~/peer/; fi
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target ~/site .whl/*.whl
  fi
}

use_gguf() {  # the GGUF for the default model: its parts (stashed, and the last in .carry2)
  # joined in name order and checked in the runner's call (carry .carry2)
  if [ ! -f "$GGUF" ]; then
    local parts
    parts=$(ls ~/gguf/gguf.part* .carry2/gguf.part* 2>/dev/null | awk -F/ '{print $NF "\t" $0}' \
      | sort | cut -f2)
    if [ -z "$parts" ] || [ ! -f .carry2/sha256 ]; then
      echo "no GGUF on this machine: see benchmarks/gpu/README.md (the parts over calls)" >&2
      return 1
    fi
    # shellcheck disable=SC2086
    cat $parts > "$GGUF.part"
    if ! echo "$(cat .carry2/sha256)  $GGUF.part" | sha256sum -c --quiet; then
      echo "the joined GGUF parts do not match .carry2/sha256: carry every part" >&2
      rm "$GGUF.part"
      return 1
    fi
    mv "$GGUF.part" "$GGUF"
  fi
  export JAXSPEC_DEFAULT_GGUF="$GGUF"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then "$@"; fi
