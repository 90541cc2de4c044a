# Helpers for the GPU session scripts (sourced after env.sh). Sessions 8 and 9 carried their own
# copies; later scripts source this file.
quiet() { grep -v "^W0000\|^I0000\|^E0000"; }  # drop XLA's log lines
stash() {  # the GGUF's first half into the home folder (for a later call), the gguf wheel
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
}
join_gguf() {  # the two halves as ~/smol.gguf, checked; the default model points at it
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || return 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
}
