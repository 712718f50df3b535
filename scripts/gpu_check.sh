#!/usr/bin/env bash
# The device check: on a CUDA machine, logits against transformers for every architecture, the
# speculative parity grid, compiled against eager, and decode speed on real shapes, in one run
# of a few minutes (docs/gpu-check.md). `--cpu` runs the same on CPU with small shapes.
#
#   bash scripts/gpu_check.sh [--cpu] [--out DIR] [--parts logits,parity,...]
#
# Installs the packages gpu_check/wheels.txt lists that do not import, from .whl/gpu-check/,
# then runs `python -m gpu_check` under a hard time limit (GPU_CHECK_LIMIT_S, default 480 s):
# past it the check stops and writes what it measured. PYTHON picks the interpreter.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -ra python <<< "${PYTHON:-python3}"
wheels="$root/.whl/gpu-check"
limit="${GPU_CHECK_LIMIT_S:-480}"

missing=()
while read -r requirement module _; do
  [[ -z "$requirement" || "$requirement" == \#* ]] && continue
  "${python[@]}" -c "import $module" 2>/dev/null || missing+=("$requirement")
done < "$root/scripts/gpu_check/wheels.txt"
if ((${#missing[@]})); then
  if ! compgen -G "$wheels/*.whl" > /dev/null; then
    echo "gpu_check: ${missing[*]} not installed and no wheels in $wheels;" \
      "fill it with the pip download line in docs/gpu-check.md" >&2
    exit 2
  fi
  if ! "${python[@]}" -m pip --version > /dev/null 2>&1; then
    echo "gpu_check: ${missing[*]} not installed and this python has no pip to install them from $wheels" >&2
    exit 2
  fi
  # --no-deps: their own dependencies (numpy, pyyaml, tqdm) come with transformers
  "${python[@]}" -m pip install --quiet --no-index --no-deps --find-links "$wheels" "${missing[@]}" ||
    { echo "gpu_check: installing ${missing[*]} from $wheels failed (see above)" >&2; exit 2; }
fi

export PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}"
if command -v timeout > /dev/null; then
  exec timeout --signal=INT --kill-after=20 "$limit" "${python[@]}" -m gpu_check "$@"
fi
exec "${python[@]}" -m gpu_check "$@"
