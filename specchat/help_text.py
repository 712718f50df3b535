"""What `specchat --help` and every subcommand's `--help` say: what it is, and commands that work as
typed with the shipped profiles (`specchat profiles` lists them; the default model is smollm2)."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
specchat is a terminal chat for local LLMs that shows whether speculative
decoding makes a model faster without changing its output. Every reply streams
with its speed; an A/B view runs the same prompt speculatively and target-only
side by side; `specchat verify` checks token for token that a draft method
changed nothing, and `specchat bench` measures what it gained."""

EPILOG = """\
examples (the first three commands):
  chat with the default model (SmolLM2-135M, fetched once):
    specchat
  check, token for token, that prompt-lookup drafting changes no output:
    specchat verify -p smollm2-ngram
  measure what it gains on this machine:
    specchat bench -p smollm2 -p smollm2-ngram

more:
  specchat profiles              the profiles: engine, draft method, model
  specchat chat -m model.gguf    any GGUF file or checkpoint directory, no
                                 profile written (-m FILE on every command)
  specchat ab -p smollm2-mtp     A/B view: MTP drafting against target-only
  specchat COMMAND --help        a command's options and examples

exit codes: 0 ok, 1 a mismatch or a runtime failure, 2 a usage or configuration
error (one line saying what to fix)"""

EPILOGS = {
    "chat": """\
examples:
  specchat                          the chat on the default (smollm2-fast)
  specchat chat -p smollm2-ngram    the chat with prompt-lookup drafting
  specchat chat -p smollm2-suffix   suffix decoding, from earlier replies too
  specchat chat -m model.gguf       a GGUF file or checkpoint directory, with
                                    the default speculation (also: specchat -m)
keys: Enter send · Esc stop · F2 profile · F3 A/B view · Ctrl+T token colours""",
    "ab": """\
examples:
  specchat ab -p smollm2-ngram             prompt lookup against target-only
  specchat ab -p smollm2-mtp -r smollm2    MTP against a named reference
  specchat ab -p smollm2 -r smollm2        the floor: target-only vs itself
  specchat ab -m model.gguf                a file's default speculation
keys: Esc stop/back · Ctrl+G race · Ctrl+L use other reply · Ctrl+F floor""",
    "repl": """\
examples:
  specchat repl                   the REPL on the default profile
  specchat repl -p smollm2-mtp    with MTP drafting
  specchat repl -m model.gguf     a GGUF file (or checkpoint directory)
inside: /profile, /ab, /verify, /system, /save, /stats, /exit;
  /schema FILE|off, /regex R|off, /grammar FILE|off: the shape of replies""",
    "run": """\
examples:
  specchat run "Explain speculative decoding in one sentence."
  specchat run -p smollm2-ngram --stats "Write a haiku about a fast computer."
  specchat run -m model.gguf "Hello"   (a GGUF file or checkpoint directory;
    the engine that runs it, and why, on stderr; -p PROFILE: its settings)
  echo "What is 17 * 23?" | specchat run -p smollm2-mtp --json
  specchat run --json-schema person.json "Ada Lovelace, born 1815, as JSON"
  specchat run --regex '[0-9]{3}-[0-9]{4}' 'Make up a phone number'""",
    "profiles": """\
examples:
  specchat profiles           the table (* the default; broken ones and why)
  specchat profiles --json    every field of every profile, as JSON""",
    "pull": """\
examples:
  specchat pull                                  fetch the default model
  specchat pull smollm2-135m-instruct --force    fetch it again""",
    "bench": """\
examples:
  specchat bench -p smollm2 -p smollm2-ngram
  specchat bench -m model.gguf -p smollm2 -p smollm2-suffix   (on that file)
  specchat bench -p smollm2-ngram -p smollm2-mtp --max-tokens 128
  specchat bench -p smollm2-mtp --prompts question.jsonl --limit 12 --json
  specchat bench -p smollm2-ngram --prompts scripts/extraction-prompts.jsonl
  specchat bench -p smollm2-ngram --prompts p.jsonl --no-constraint
(question.jsonl: Spec-Bench's prompts, or any jsonl or text file; speed-ups
are against target-only, measured in the same run)""",
    "ladder": """\
examples:
  specchat ladder -p smollm2-ngram --depths 1-6
  specchat ladder -m model.gguf --depths 1-7
  specchat ladder -p smollm2-dflash --depths 1-3 --plot ladder.png
  specchat ladder -p smollm2-mtp --depths 1,2,4 --plot ladder.svg""",
    "verify": """\
examples:
  specchat verify -p smollm2-ngram
  specchat verify -m model.gguf --prompts question.jsonl --limit 20
  specchat verify -p smollm2-mtp --prompts question.jsonl --limit 20
  specchat verify -p smollm2-draft -r smollm2 --json
  specchat verify -p smollm2-ngram --repeat 3  (does the target repeat itself?)
  specchat verify -p smollm2-ngram --json-schema person.json --prompts p.jsonl
(exit 0: identical, floating-point near-ties, or a target that does not
reproduce itself, reported as such; exit 1: a mismatch, or a reply that
breaks its constraint)""",
    "train": """\
examples (prompts, the target's replies to them, a drafter; docs/training.md):
  specchat train prompts --out runs/prompts.jsonl --count 200
  specchat train data --prompts runs/prompts.jsonl --out runs/data
  specchat train mtp --data runs/data --out runs/my-mtp --steps 600""",
    "train prompts": """\
examples:
  specchat train prompts --target smollm2 --out runs/prompts.jsonl --count 200""",
    "train data": """\
examples:
  specchat train data --prompts runs/prompts.jsonl --out runs/data
  specchat train data --prompts runs/prompts.jsonl --out runs/data --batch 48""",
    "train tasks": """\
examples:
  specchat train tasks --kind documents --count 40 --out runs/documents
  specchat train tasks --kind conversations --count 200 --out runs/chats""",
    "train corpus": """\
examples:
  specchat train corpus --data runs/data --out profiles/drafters/corpus/smollm2""",
    "train unpack": """\
examples:
  specchat train unpack --corpus profiles/drafters/corpus/smollm2 \\
      --out runs/data""",
    "train draft": """\
examples:
  specchat train draft --data runs/data --out runs/my-draft --steps 300
  specchat train draft --data runs/data --out runs/my-draft --layers 2 \\
      --hidden 192 --steps 300""",
    "train replayssm": """\
examples:
  specchat train replayssm --data runs/data --out runs/my-rssm --steps 300
  specchat train replayssm --data runs/data --out runs/my-rssm --layers 3 \\
      --hidden 192 --linear-heads 2 --steps 300""",
    "train mtp": """\
examples:
  specchat train mtp --target smollm2 --data runs/data --out runs/my-mtp""",
    "train eagle3": """\
examples:
  specchat train eagle3 --target smollm2 --data runs/data --out runs/my-eagle3
  specchat train eagle3 --data runs/data --out runs/my-eagle3 --ttt-steps 5 \\
      --taps 2 15 27""",
    "train dflash": """\
examples:
  specchat train dflash --data runs/data --out runs/my-dflash --block-size 4""",
    "train dspark": """\
examples:
  specchat train dspark --data runs/data --out runs/my-dspark \\
      --init profiles/drafters/smollm2-dflash""",
    "train export-gguf": """\
examples:
  specchat train export-gguf profiles/drafters/smollm2-eagle3 --out e3.gguf
  then: llama-server -m TARGET.gguf --spec-type draft-eagle3 -md e3.gguf""",
    "train cost": """\
examples:
  specchat train cost --target smollm2 --layers 1 2 --hidden 128 192 256""",
}

SUMMARIES = {
    "chat": "open the chat (the default command)",
    "ab": "A/B split view: speculative vs target-only",
    "repl": "plain line REPL",
    "run": "one prompt, streamed to stdout",
    "profiles": "list profiles with their method and model",
    "pull": "fetch a named model into the cache",
    "bench": "measure decode speed, acceptance and speed-up over a prompt set",
    "ladder": "one speculative profile at every draft depth: acceptance, speed-up, plateau",
    "verify": "check that speculative output equals target-only output, token for token",
    "train": "train a draft model for a target (distillation data, then the drafter)",
    "train prompts": "let the target write training prompts itself (Magpie): varied, no dataset",
    "train data": "let the target answer training prompts; store replies and top-k probabilities",
    "train tasks": "let the target write documents, conversations, math or code and work on them: data like users' requests",
    "train corpus": "pack `train data` replies into the repository's corpus (token ids only)",
    "train unpack": "a `train data` directory from a packed corpus (top-k recomputed)",
    "train draft": "train a small Llama draft model on `train data` output",
    "train replayssm": "train a small recurrent (Gated DeltaNet) draft model on `train data` output",
    "train mtp": "train an MTP head on the target's own hidden states (`train data` output)",
    "train eagle3": "train an EAGLE-3 head (three target layers fused, training-time test) on `train data` "
                    "output; SpecForge's layout, which vLLM and SGLang load",
    "train dflash": "train a DFlash block drafter (uses the target's hidden states, embedding and head) on "
                    "`train data` output",
    "train dspark": "train a DSpark drafter: a low-rank Markov head (each draft corrected from the one before) "
                    "on top of a DFlash drafter, on `train data` output",
    "train export-gguf": "write a trained drafter (EAGLE-3 head, DFlash or DSpark drafter, draft model) as the GGUF "
                         "llama.cpp's llama-server drafts with",
    "train cost": "measure per-token cost of drafter shapes next to the target's",
}


def subcommand(name: str) -> dict:
    """add_parser keywords for subcommand `name` ("bench", "train mtp"): its one-line help, the same
    line atop its own --help, and its examples below, kept as written."""
    return {"help": SUMMARIES[name], "description": SUMMARIES[name], "epilog": EPILOGS[name],
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def top_level() -> dict:
    return {"description": DESCRIPTION, "epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
