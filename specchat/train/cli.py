"""`specchat train prompts|data|tasks|corpus|unpack|draft|replayssm|mtp|eagle3|dflash|dspark|export-gguf`: argparse wiring (added to the main parser by `add_train_parser`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specchat.help_text import subcommand
from specchat.profiles import get_profile
from specchat.train import BATCH_DTYPES
from specchat.train.settings import (DFlashTrainConfig, DraftTrainConfig, DSparkTrainConfig, Eagle3TrainConfig,
                                     MtpTrainConfig, add_training_flags, config_from_args)
from specchat.train.tasks import KINDS


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def cmd_data(args) -> int:
    from specchat.train.data import make_data

    profile = get_profile(args.target)
    if args.threads is not None:
        profile = profile.model_copy(update={"threads": args.threads})
    make_data(profile, args.prompts, Path(args.out), max_tokens=args.max_tokens, limit=args.limit,
              top_k=args.top_k, temperature=args.temperature, seed=args.seed, instances=args.instances,
              variants=args.variants, batch=args.batch, dtype=args.dtype, say=_say)
    return 0


def cmd_tasks(args) -> int:
    from specchat.train.tasks import make_tasks

    profile = get_profile(args.target)
    if args.threads is not None:
        profile = profile.model_copy(update={"threads": args.threads})
    make_tasks(profile, args.kind, Path(args.out), args.count, top_k=args.top_k, temperature=args.temperature,
               seed=args.seed, batch=args.batch, dtype=args.dtype, max_tokens=args.max_tokens, say=_say)
    return 0


def cmd_corpus(args) -> int:
    from specchat.train.corpus import pack

    for data in args.data:
        added = pack(Path(data), Path(args.out))
        _say(f"{data}: {added} new samples packed into {args.out}")
    return 0


def cmd_unpack(args) -> int:
    from specchat.train.corpus import unpack

    profile = get_profile(args.target)
    if args.threads is not None:
        profile = profile.model_copy(update={"threads": args.threads})
    unpack(Path(args.corpus), Path(args.out), profile, top_k=args.top_k, say=_say)
    return 0


def cmd_prompts(args) -> int:
    from specchat.train.self_prompts import make_prompts

    profile = get_profile(args.target)
    if args.threads is not None:
        profile = profile.model_copy(update={"threads": args.threads})
    make_prompts(profile, Path(args.out), args.count, temperature=args.temperature, top_p=args.top_p,
                 max_tokens=args.max_tokens, batch=args.batch, seed=args.seed, dtype=args.dtype, say=_say)
    return 0


def cmd_draft(args) -> int:
    from specchat.train.draft import DraftShape, train_draft

    recurrent = args.train_command == "replayssm"
    shape = DraftShape(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       ffn=args.ffn, recurrent=recurrent, **({"linear_heads": args.linear_heads,
                                                           "linear_head_dim": args.linear_head_dim} if recurrent else {}))
    cfg = config_from_args(DraftTrainConfig, args)
    train_draft(get_profile(args.target), [Path(d) for d in args.data], Path(args.out), shape, cfg, say=_say)
    return 0


def cmd_mtp(args) -> int:
    from specchat.train.mtp import train_mtp

    cfg = config_from_args(MtpTrainConfig, args)
    train_mtp(get_profile(args.target), [Path(d) for d in args.data], Path(args.out), cfg, say=_say)
    return 0


def cmd_eagle3(args) -> int:
    from specchat.train.eagle3 import train_eagle3

    cfg = config_from_args(Eagle3TrainConfig, args)
    train_eagle3(get_profile(args.target), [Path(d) for d in args.data], Path(args.out), cfg, say=_say)
    return 0


def cmd_dflash(args) -> int:
    from specchat.train.dflash import DFlashShape, train_dflash

    shape = DFlashShape(layers=args.layers, ffn=args.ffn, block_size=args.block_size,
                        target_layers=args.target_layers or [], mask_token_id=args.mask_token_id)
    cfg = config_from_args(DFlashTrainConfig, args)
    train_dflash(get_profile(args.target), [Path(d) for d in args.data], Path(args.out), shape, cfg, say=_say)
    return 0


def cmd_dspark(args) -> int:
    from specchat.train.dspark import DSparkShape, train_dspark

    shape = DSparkShape(init=Path(args.init), rank=args.rank, train_backbone=args.train_backbone)
    cfg = config_from_args(DSparkTrainConfig, args)
    train_dspark(get_profile(args.target), [Path(d) for d in args.data], Path(args.out), shape, cfg, say=_say)
    return 0


def cmd_cost(args) -> int:
    import json

    from specchat.train.cost import measure
    from specchat.train.draft import DraftShape

    shapes = [DraftShape(layers=n, hidden=h, heads=max(1, h // 64), kv_heads=max(1, h // 128), ffn=3 * h)
              for n in args.layers for h in args.hidden]
    rows = measure(get_profile(args.target), shapes, threads=args.threads, say=_say)
    if args.json:
        print(json.dumps(rows))
    return 0


def cmd_export_gguf(args) -> int:
    from specchat.server_drafters import export_drafter

    drafter = Path(args.drafter)
    out = Path(args.out) if args.out else drafter.parent / f"{drafter.name}.gguf"
    method, path = export_drafter(drafter, get_profile(args.target), out, args.method)
    _say(f"{drafter}: written as llama.cpp's {method} drafter to {path} (llama-server --spec-draft-model)")
    print(path)
    return 0


def add_train_parser(sub) -> None:
    tp = sub.add_parser("train", **subcommand("train"))
    tsub = tp.add_subparsers(dest="train_command", required=True)

    p = tsub.add_parser("prompts", **subcommand("train prompts"))
    p.add_argument("--target", default="smollm2", help="target profile (an instruction-tuned model)")
    p.add_argument("--out", required=True, help="jsonl file to append to (resumable: a run stops at --count)")
    p.add_argument("--count", type=int, default=1000, help="prompts wanted in the file (default 1000)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=96, help="a prompt not finished by then is dropped")
    p.add_argument("--batch", type=int, default=48, help="prompts written at once (transformers' model)")
    p.add_argument("--dtype", choices=BATCH_DTYPES, default="bfloat16",
                   help="precision of the batched model (default bfloat16: ~1.8x float32's rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="override the profile's threads")
    p.set_defaults(func=cmd_prompts)

    p = tsub.add_parser("data", **subcommand("train data"))
    p.add_argument("--target", default="smollm2", help="target profile (torch backend)")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="prompt files (self-instruct jsonl, {\"prompt\": ...} jsonl or text); never Spec-Bench")
    p.add_argument("--out", required=True, help="data directory (resumable: prompts already there are skipped)")
    p.add_argument("--max-tokens", type=int, default=128, help="reply length cap (default 128)")
    p.add_argument("--limit", type=int, help="at most N prompts")
    p.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy replies (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instances", action="store_true",
                   help="every self-instruct instance input becomes its own prompt")
    p.add_argument("--variants", action="store_true",
                   help="also derived prompts per self-instruct task: summarise, translate, answer from a "
                        "document, rewrite, explain, key points, continue")
    p.add_argument("--batch", type=int, default=1,
                   help="N > 1: decode N replies at once with transformers' model of the target "
                        "(several times one-by-one decoding; replies may part from the engine's at near-ties)")
    p.add_argument("--dtype", choices=BATCH_DTYPES, default="bfloat16",
                   help="precision of the batched model (with --batch; default bfloat16: ~1.8x float32's rate)")
    p.add_argument("--threads", type=int, help="override the profile's threads (1 is fastest on a busy machine)")
    p.set_defaults(func=cmd_data)

    p = tsub.add_parser("tasks", **subcommand("train tasks"))
    p.add_argument("--target", default="smollm2", help="target profile (torch backend)")
    p.add_argument("--kind", required=True, choices=KINDS,
                   help="documents (written, then summarised, questioned, translated, edited), conversations "
                        "(two turns, the target writing the user's too), math (posed, then solved step by step), "
                        "code (written, then explained, edited, tested)")
    p.add_argument("--count", type=int, required=True, help="items wanted in the directory (several samples each)")
    p.add_argument("--out", required=True, help="data directory (resumable: items already there are skipped)")
    p.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position (default 32)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="for the material the target writes (documents, problems, user turns); work on it is greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="items decoded at once (transformers' model)")
    p.add_argument("--max-tokens", type=int, help="cap every stage's reply length (stages have their own, up to 384)")
    p.add_argument("--dtype", choices=BATCH_DTYPES, default="bfloat16",
                   help="precision of the batched model (default bfloat16)")
    p.add_argument("--threads", type=int, help="override the profile's threads")
    p.set_defaults(func=cmd_tasks)

    p = tsub.add_parser("corpus", **subcommand("train corpus"))
    p.add_argument("--data", nargs="+", required=True, help="`train data` directories to pack")
    p.add_argument("--out", required=True, help="corpus directory (new samples are appended)")
    p.set_defaults(func=cmd_corpus)

    p = tsub.add_parser("unpack", **subcommand("train unpack"))
    p.add_argument("--target", default="smollm2", help="the target profile that wrote the corpus")
    p.add_argument("--corpus", required=True, help="a packed corpus directory")
    p.add_argument("--out", required=True, help="data directory to write (resumable)")
    p.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position (default 32)")
    p.add_argument("--threads", type=int, help="override the profile's threads")
    p.set_defaults(func=cmd_unpack)

    p = tsub.add_parser("draft", **subcommand("train draft"))
    add_training_flags(p, DraftTrainConfig(), "model")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--freeze-embedding", action="store_true",
                   help="keep the projected target embedding (and tied head) fixed; trains only the layers")
    p.set_defaults(func=cmd_draft)

    p = tsub.add_parser("replayssm", **subcommand("train replayssm"))
    add_training_flags(p, DraftTrainConfig(), "model")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--linear-heads", type=int, default=2, help="key heads per layer (value heads: twice as many)")
    p.add_argument("--linear-head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=576)
    p.add_argument("--freeze-embedding", action="store_true",
                   help="keep the projected target embedding (and tied head) fixed; trains only the layers")
    p.set_defaults(func=cmd_draft, heads=1, kv_heads=1)  # no attention layers

    p = tsub.add_parser("mtp", **subcommand("train mtp"))
    add_training_flags(p, MtpTrainConfig(), "head")
    p.add_argument("--top-k", type=int, default=32, help="target probabilities kept per entry (default 32)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the head may propose: the target's N most frequent choices (0: all)")
    p.add_argument("--hidden-source", choices=["post_norm", "pre_norm"], default="post_norm",
                   help="target state fed to the head: after the final norm (default) or the last layer's output")
    p.add_argument("--depth2-weight", type=float, default=0.5,
                   help="weight of the second drafting step's loss (the head fed its own output); 0: off")
    p.set_defaults(func=cmd_mtp)

    p = tsub.add_parser("eagle3", **subcommand("train eagle3"))
    add_training_flags(p, Eagle3TrainConfig(), "head")
    p.add_argument("--top-k", type=int, default=32, help="target probabilities kept per entry (default 32)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the head may propose: the target's N most frequent choices (0: all)")
    p.add_argument("--taps", type=int, nargs="+", metavar="J",
                   help="target layers whose input the head fuses (default: the published 2, L/2, L-3)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="drafting steps unrolled in training, each fed the last one's output (default 3)")
    p.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of step s: DECAY^s (default 0.8)")
    p.set_defaults(func=cmd_eagle3)

    p = tsub.add_parser("dflash", **subcommand("train dflash"))
    add_training_flags(p, DFlashTrainConfig(), "drafter")
    p.add_argument("--layers", type=int, default=1, help="draft layers (hidden size and heads are the target's)")
    p.add_argument("--ffn", type=int, default=0, help="MLP size of the draft layers (default: the target's)")
    p.add_argument("--block-size", type=int, default=4, help="block B: drafts up to B-1 tokens per pass (default 4)")
    p.add_argument("--target-layers", type=int, nargs="+", metavar="I",
                   help="target decoder layers whose outputs condition the drafter (default: the published rule)")
    p.add_argument("--mask-token-id", type=int, help="token id of the block's masks (default: the tokenizer's mask "
                                                     "token, else its highest added non-EOS token)")
    p.add_argument("--anchors", type=int, default=16, help="blocks per reply and step (default 16)")
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight of block position k: exp(-(k-1)/gamma)")
    p.set_defaults(func=cmd_dflash)

    p = tsub.add_parser("dspark", **subcommand("train dspark"))
    add_training_flags(p, DSparkTrainConfig(), "drafter")
    p.add_argument("--init", required=True, help="the DFlash drafter directory to build on (its block, layers and "
                                                 "target layers), e.g. profiles/drafters/smollm2-dflash")
    p.add_argument("--rank", type=int, default=64, help="rank r of the Markov head W2 . W1[prev] (default 64)")
    p.add_argument("--train-backbone", action="store_true",
                   help="train the DFlash drafter too (default: frozen, only the Markov head trains)")
    p.add_argument("--tv-weight", type=float, default=0.9,
                   help="weight of total variation to the target's top-k (default 0.9; DeepSpec's 0.1 CE + 0.9 TV)")
    p.add_argument("--anchors", type=int, default=16, help="blocks per reply and step (default 16)")
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight of block position k: exp(-(k-1)/gamma)")
    p.set_defaults(func=cmd_dspark)

    p = tsub.add_parser("export-gguf", **subcommand("train export-gguf"))
    p.add_argument("drafter", help="a drafter directory: an EAGLE-3 head, a DFlash or DSpark drafter or a "
                                           "draft model")
    p.add_argument("--target", default="smollm2", help="the profile of the drafter's target, whose GGUF gives the "
                                                      "tokenizer (default smollm2)")
    p.add_argument("--method", choices=("eagle3", "dflash", "dspark", "draft"),
                   help="the layout (default: from config.json)")
    p.add_argument("--out", help="the GGUF to write (default: DRAFTER.gguf beside the directory)")
    p.set_defaults(func=cmd_export_gguf)

    p = tsub.add_parser("cost", **subcommand("train cost"))
    p.add_argument("--target", default="smollm2")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 192, 256])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cost)
