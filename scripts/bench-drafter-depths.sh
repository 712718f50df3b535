#!/usr/bin/env bash
# Held-out evaluation of the shipped SmolLM2 drafter: Spec-Bench prompts (evaluation only), depths 1..6,
# greedy and temperature 0.7, plus the lossless check. Writes bench-*.json and verify-*.json into OUT.
#   [TEMP_LIMIT=N] [VERIFY_LIMIT=N] [VERIFY_DEPTH=D] scripts/bench-drafter-depths.sh OUT [LIMIT] [MAX_TOKENS] [THREADS] [DEPTHS] [TEMPS]
set -euo pipefail
out=${1:?output directory}; limit=${2:-24}; max_tokens=${3:-64}; threads=${4:-1}
depths=${5:-"1 2 3 4 5 6"}; temps=${6:-"0 0.7"}
root=$(cd "$(dirname "$0")/.." && pwd)
prompts=${PROMPTS:-$root/../shared/data/spec-bench/question.jsonl}
mkdir -p "$out"
export SPECCHAT_PROFILES_DIR=$(mktemp -d)
# the same target settings for the reference and every speculative row (threads: 1 is fastest on a busy box)
printf 'extends: smollm2\nthreads: %s\n' "$threads" > "$SPECCHAT_PROFILES_DIR/t.yaml"
args=(-p t)
for d in $depths; do
  printf 'extends: t\nspeculative:\n  method: draft\n  depth: %s\n  drafter: %s\n' \
    "$d" "$root/profiles/drafters/smollm2-draft" > "$SPECCHAT_PROFILES_DIR/draft-d$d.yaml"
  args+=(-p "draft-d$d")
done
cd "$root"
for t in $temps; do
  lim=$limit; [ "$t" != 0 ] && lim=${TEMP_LIMIT:-$limit}
  python3 -m specchat.cli bench "${args[@]}" --prompts "$prompts" --limit "$lim" --max-tokens "$max_tokens" \
    --temperature "$t" --json > "$out/bench-t$t.json"
  python3 -m specchat.cli verify -p "draft-d${VERIFY_DEPTH:-4}" --prompts "$prompts" --limit "${VERIFY_LIMIT:-12}" \
    --max-tokens "$max_tokens" --temperature "$t" --json > "$out/verify-t$t.json" || true
done
