"""Repeated work through `specchat run`, as a script or an agent sends it: every prompt of a file
once, then every prompt again, each a fresh `specchat run --json` process sharing one fresh data
directory (so the only link between runs is the history database). Prints per prompt the tokens per
pass of each send and whether the replies are token-identical, then the totals per round.

    python scripts/run_repeated.py scripts/repeated-work-prompts.jsonl [PROFILE] [MAX_TOKENS]

Tokens per pass is tokens over every target pass (`tokens_per_pass` in `run --json`).
"""
import json
import os
import subprocess
import sys
import tempfile

from specchat.prompts import load_prompts

prompts = load_prompts(sys.argv[1])
profile = sys.argv[2] if len(sys.argv) > 2 else "smollm2-suffix"
max_tokens = sys.argv[3] if len(sys.argv) > 3 else "128"
env = dict(os.environ, SPECCHAT_DATA_DIR=tempfile.mkdtemp(prefix="specchat-repeated-"))


def run(text: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "specchat.cli", "run", "-p", profile, "--json", "--max-tokens",
                           max_tokens, text], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


rounds = [[run(p.turns[0]) for p in prompts] for _ in range(2)]
same = 0
print(f"{'prompt':<24} {'t/pass 1st':>10} {'t/pass 2nd':>10} {'ratio':>6}  identical")
for p, first, second in zip(prompts, *rounds):
    ok = first["token_ids"] == second["token_ids"]
    same += ok
    ratio = second["tokens_per_pass"] / first["tokens_per_pass"]
    print(f"{p.id:<24} {first['tokens_per_pass']:>10.2f} {second['tokens_per_pass']:>10.2f} {ratio:>5.2f}x  {ok}")
totals = [sum(r["tokens"] for r in rnd) / sum(r["passes"] for r in rnd) for rnd in rounds]
print(f"{profile}, {len(prompts)} prompts, {max_tokens} tokens: tokens per pass {totals[0]:.2f} (first send) -> "
      f"{totals[1]:.2f} (second), {totals[1] / totals[0]:.2f}x; token-identical {same}/{len(prompts)}")
