"""The `specchat` command.

Exit codes: 0 ok, 2 usage or configuration error (one clear line on stderr), 1 runtime failure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Optional

from specchat import help_text
from specchat.backends.base import BackendError, Request, Summary
from specchat.live import background_note, stats_line
from specchat.profiles import DEFAULT_PROFILE, ProfileError, get_profile, load_profiles
from specchat.train.cli import add_train_parser

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def _err(msg: str) -> None:
    print(f"specchat: error: {msg}", file=sys.stderr)


def _overridden(profile, args):
    """The profile with this command's flags applied (sampling flags and --set KEY=VALUE)."""
    import yaml

    settings = {f"sampling.{k}": getattr(args, k, None) for k in ("temperature", "top_p", "top_k", "seed", "max_tokens")}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set speculative.depth=3")
        settings[key.strip()] = yaml.safe_load(value)
    return profile.with_overrides(settings)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, help="override the profile's sampling.max_tokens")
    p.add_argument("--temperature", type=float, help="override sampling.temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, help="override sampling.top_p")
    p.add_argument("--top-k", type=int, help="override sampling.top_k")
    p.add_argument("--seed", type=int, help="override sampling.seed")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any profile field for this run, e.g. dtype=bfloat16 or speculative.depth=3")


def _count(flag: str):
    """An argparse `type=` for a count of 1 or more; anything else is a UsageError (one line, exit 2)."""
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise UsageError(f"{flag} {text}: expected a whole number of 1 or more (e.g. {flag} 3)")
        return int(text)
    return parse


def _add_prompt_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="prompt file (Spec-Bench question.jsonl, jsonl or text)")
    p.add_argument("--limit", type=_count("--limit"), help="at most N prompts, spread over the subtasks")
    p.add_argument("--category", action="append", help="only these categories / subtasks")


def _prompt_set(args):
    """The prompts `--prompts/--limit/--category` name, or two short chat prompts."""
    from specchat.prompts import PromptItem, load_prompts

    if args.prompts:
        return load_prompts(args.prompts, args.limit, args.category)
    return [PromptItem("1", ["Explain speculative decoding in three sentences."]),
            PromptItem("2", ["Write a haiku about a fast computer."])]


def _run_line(label: str, r) -> str:
    """One prompt's figures in a bench or ladder run: which, and its stats line."""
    return f"  {label} · {r.prompt.id} [{r.prompt.task}] {stats_line(r.summary)}"


# ---------------------------------------------------------------------------------- run

def cmd_run(args) -> int:
    from specchat.loading import load_backend, messages_for, sampling_of
    from specchat.stdin_text import StdinText

    prompt = args.prompt if args.prompt is not None else StdinText().read()
    if not prompt.strip():
        raise UsageError("empty prompt: pass it as an argument or on stdin")
    profile = _overridden(get_profile(args.profile), args)
    backend = load_backend(profile, background=True, start_background=False)  # started after the reply
    request = Request(messages=messages_for(profile, [{"role": "user", "content": prompt}], args.system))
    cancel = threading.Event()
    summary: Optional[Summary] = None
    try:
        events = backend.stream(request, sampling_of(profile), cancel)  # a refused prompt: exit 2
        try:
            for ev in events:
                if isinstance(ev, Summary):
                    summary = ev
                elif not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except BackendError as e:  # the reply broke off (a server that died, timed out): a runtime failure
            if not args.json:
                sys.stdout.write("\n")
            _err(str(e))
            return EXIT_RUNTIME
        note = background_note(backend)
    except KeyboardInterrupt:
        cancel.set()
        return 130
    finally:
        backend.close()
    assert summary is not None
    if args.json:
        out = {"profile": profile.name, "backend": profile.backend, "method": profile.method,
               "depth": profile.speculative.depth if profile.method != "none" else 0, **summary.as_dict()}
        out["decode_tok_s"] = summary.decode_tok_s
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        if args.stats:
            print(stats_line(summary, stop=True), file=sys.stderr)
    if note:
        print(f"specchat: {note}", file=sys.stderr)
    if summary.error:
        _err(summary.error)
        return EXIT_RUNTIME
    return EXIT_OK


# ----------------------------------------------------------------------------- profiles

def cmd_profiles(args) -> int:
    from rich.console import Console

    from specchat import availability

    ps = load_profiles()
    found = availability.classify(ps, probe_servers=not args.no_probe, unprobed="server not asked (--no-probe)")
    if args.json:
        print(json.dumps(availability.as_json(ps, found)))
    else:
        availability.print_listing(Console(), found, wide=args.wide)
    return EXIT_OK


def cmd_pull(args) -> int:
    from specchat.models import pull

    path = pull(args.name, force=args.force)
    print(path)
    return EXIT_OK


# -------------------------------------------------------------------------------- bench

def cmd_bench(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from specchat import bench

    profiles = [_overridden(get_profile(n), args) for n in (args.profile or [DEFAULT_PROFILE])]
    prompts = _prompt_set(args)
    console = Console(stderr=True)
    extra = []
    if args.transformers:
        from specchat.loading import load_transformers

        base = next((p for p in profiles if p.backend == "torch"), profiles[0]).target_only()
        for dtype in args.transformers:
            ref = base.model_copy(update={"name": f"transformers-{dtype}", "dtype": dtype})
            extra.append((ref.name, lambda ref=ref: load_transformers(ref), ref))
    results = bench.bench(
        profiles, prompts, interleave=not args.sequential,
        on_load=lambda label: console.print(f"[bold]{label}[/bold]: loading…"),
        on_run=lambda label, r: console.print(escape(_run_line(label, r)), highlight=False),
        extra_rows=extra, repeat=args.repeat)
    if args.json:
        print(json.dumps(bench.to_json(results)))
    else:
        Console().print(bench.render(results))
    return EXIT_OK


# -------------------------------------------------------------------------------- ladder

def cmd_ladder(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from specchat import ladder, plot

    depths = ladder.parse_depths(args.depths)
    if args.plot and (problem := plot.plot_problem(args.plot)):
        raise UsageError(problem)
    profile = _overridden(get_profile(args.profile), args)
    ladder.check(profile)
    prompts = _prompt_set(args)
    console = Console(stderr=True)
    console.print(f"[bold]{escape(profile.name)}[/bold]: loading…")
    result = ladder.run_ladder(profile, depths, prompts,
                               on_run=lambda label, r: console.print(escape(_run_line(label, r)), highlight=False))
    if args.plot:
        plot.write_ladder_plot(result, args.plot)
        console.print(f"chart written to {escape(args.plot)}", highlight=False)
    if args.json:
        print(json.dumps(ladder.to_json(result)))
    else:
        Console().print(ladder.render(result))
    return EXIT_OK


# ------------------------------------------------------------------------------- verify

def cmd_verify(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from specchat.compare import mark_and_colour
    from specchat.live import peak_rss_bytes, speculation_note
    from specchat.loading import load_backend, load_reference, sampling_of
    from specchat.verify import check_conversation, summarize

    spec_profile = _overridden(get_profile(args.profile), args)
    if spec_profile.remote and not args.reference:
        spec_profile.target_only()  # raises: a server's speculation can't be switched off from here
    if spec_profile.method == "none" and not spec_profile.remote and not args.reference:
        raise UsageError(f"profile '{spec_profile.name}' has no speculative method; verify compares a "
                         "speculative profile with its target-only reference (or with -r REFERENCE)")
    prompts = _prompt_set(args)
    console = Console(stderr=True, highlight=False)
    spec = load_backend(spec_profile)
    reference = load_reference(spec_profile, spec, get_profile(args.reference) if args.reference
                               else spec_profile.target_only())  # on spec's own weights where it can
    sampling = sampling_of(spec_profile)
    checks = []
    turns = 1 if args.turns == "first" else 1_000
    try:
        for item in prompts:
            for check, left_out in check_conversation(spec, reference, spec_profile, item, sampling, turns):
                checks.append(check)
                if left_out:
                    console.print(escape(f"  {check.label}: {left_out}"))
                symbol, colour = mark_and_colour(check.verdict)
                mark = f"[{colour}]{symbol}[/{colour}]" if colour else symbol
                note = speculation_note(check.speculative)
                console.print(f"{mark} {check.label} " + escape(
                    f"[{item.task}] {check.verdict.line()}" + (f" · {note}" if note else "")))
    finally:
        # servers specchat started hold their weights in processes of their own: count them too
        servers_rss = [b.server_peak_rss_bytes() for b in (spec, reference) if hasattr(b, "server_peak_rss_bytes")]
        spec.close()
        reference.close()
    totals = summarize(checks)
    strict = getattr(spec, "strict", None)  # None: a server or llama.cpp verifies its own way
    if args.json:
        print(json.dumps({"profile": spec_profile.name, "reference": args.reference or f"{spec_profile.name} (target-only)",
                          "strict": strict, "reference_shares_weights": getattr(reference, "shares_weights", False),
                          "peak_rss_bytes": peak_rss_bytes(),
                          "server_peak_rss_bytes": sum(r or 0 for r in servers_rss) if servers_rss else None, **totals, "prompts_checked": [c.as_dict() for c in checks]}))
    else:
        how = {True: " (strict verification)", None: "",
               False: " (verification not strict: floating-point near-ties may flip a token, and each near-tie is "
                      "a token the speculative run's own verify row chose)"}[strict]
        checked = f"{totals['prompts']} prompts" if turns == 1 else f"{totals['prompts']} turns of {len(prompts)} prompts"
        print(f"{checked}: {totals['identical']} identical, {totals['near_ties']} near-ties, "
              f"{totals['mismatches']} mismatches{how}")
    return EXIT_RUNTIME if totals["mismatches"] else EXIT_OK


# ----------------------------------------------------------------------- chat / repl

def cmd_chat(args) -> int:
    from specchat.tui.app import run_chat

    return run_chat(args.profile or DEFAULT_PROFILE)


def cmd_ab(args) -> int:
    from specchat.tui.app import run_ab

    return run_ab(args.profile, args.reference)


def cmd_repl(args) -> int:
    from specchat.repl import run_repl

    return run_repl(args.profile or DEFAULT_PROFILE)


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specchat", **help_text.top_level())
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command")

    p = sub.add_parser("chat", **help_text.subcommand("chat"))
    p.add_argument("-p", "--profile")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ab", **help_text.subcommand("ab"))
    p.add_argument("-p", "--profile", required=True)
    p.add_argument("-r", "--reference", help="reference profile (default: the same with speculation off)")
    p.set_defaults(func=cmd_ab)

    p = sub.add_parser("repl", **help_text.subcommand("repl"))
    p.add_argument("-p", "--profile")
    p.set_defaults(func=cmd_repl)

    p = sub.add_parser("run", **help_text.subcommand("run"))
    p.add_argument("-p", "--profile")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    p.add_argument("--system", help="system prompt for this run")
    p.add_argument("--json", action="store_true", help="print one JSON summary instead of the text")
    p.add_argument("--stats", action="store_true", help="print a stats line on stderr")
    _add_sampling_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("profiles", **help_text.subcommand("profiles"))
    p.add_argument("--json", action="store_true", help="as JSON, with each profile's group and reason")
    p.add_argument("--wide", action="store_true", help="descriptions too, and nothing cut to the terminal's width")
    p.add_argument("--no-probe", action="store_true", help="do not ask servers whether they answer")
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("pull", **help_text.subcommand("pull"))
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("bench", **help_text.subcommand("bench"))
    p.add_argument("-p", "--profile", action="append", help="profile to run (repeatable)")
    _add_prompt_flags(p)
    _add_sampling_flags(p)
    p.add_argument("--sequential", action="store_true",
                   help="load and measure one profile at a time (default: all loaded, taking turns per prompt)")
    p.add_argument("--transformers", action="append", metavar="DTYPE", choices=["float32", "bfloat16"],
                   help="add a transformers `generate` reference row in this dtype (repeatable)")
    p.add_argument("--repeat", type=_count("--repeat"), default=1, metavar="N",
                   help="run each prompt N times per profile and keep its median-speed run (default 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("ladder", **help_text.subcommand("ladder"))
    p.add_argument("-p", "--profile", required=True, help="a speculative profile (e.g. smollm2-mtp)")
    p.add_argument("--depths", default="1-6", help="draft depths: a range like 1-6 or a list like 1,2,4 (default 1-6)")
    _add_prompt_flags(p)
    p.add_argument("--plot", metavar="FILE", help="also draw the chart (matplotlib) into FILE: .png or .svg")
    p.add_argument("--json", action="store_true")
    _add_sampling_flags(p)
    p.set_defaults(func=cmd_ladder)

    p = sub.add_parser("verify", **help_text.subcommand("verify"))
    p.add_argument("-p", "--profile", required=True, help="the speculative profile")
    p.add_argument("-r", "--reference", help="reference profile (default: the same profile, speculation off)")
    _add_prompt_flags(p)
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="multi-turn prompts: check the first turn, or every turn as one conversation")
    p.add_argument("--json", action="store_true")
    _add_sampling_flags(p)
    p.set_defaults(func=cmd_verify)

    add_train_parser(sub)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            args = parser.parse_args(["chat", *(argv or sys.argv[1:])])
    except UsageError as e:  # a flag's value its type= refused (_count)
        _err(str(e))
        return EXIT_USAGE
    debug = args.debug or bool(os.environ.get("SPECCHAT_DEBUG"))
    try:
        return args.func(args)
    except (ProfileError, BackendError, UsageError) as e:
        if debug:
            raise
        _err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a runtime failure: one line, the traceback only with --debug
        if debug:
            raise
        _err(f"{type(e).__name__}: {e} (rerun with --debug for the traceback)")
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
