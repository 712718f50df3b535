"""llama-server's command line for a model, a context and a speculative method.

specchat's method names map onto llama.cpp's speculative types (`--spec-type`, llama.cpp's
common/speculative.cpp): ngram onto its n-gram types, and each model drafter onto its draft type,
whose weights come in `--spec-draft-model` (`-md`): a whole draft model (draft-simple), an EAGLE-3
head (draft-eagle3), a DFlash or DSpark block drafter (draft-dflash, draft-dspark; DSpark's is a
DFlash file with a Markov head), or for draft-mtp none at all (the target's own `nextn` layers) or
an MTP sidecar file. llama.cpp's other settings are reached with explicit arguments instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ..base import BackendError

# For each n-gram type, the flags of its lookup length and of its draft length (llama.cpp's common/arg.cpp).
NGRAM_SIZE_FLAGS = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m"),
    "ngram-mod": ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max"),
    "ngram-cache": (None, None),
}


# specchat's model-drafter methods -> llama.cpp's draft types
DRAFT_TYPES = {"draft": "draft-simple", "mtp": "draft-mtp", "eagle3": "draft-eagle3", "dflash": "draft-dflash",
               "dspark": "draft-dspark"}
METHODS = ("none", "ngram", *DRAFT_TYPES)


def speculation_args(method: str, *, ngram_type: str = "ngram-simple", depth: Optional[int] = None,
                     lookup: Optional[int] = None, drafter: Optional[Path] = None,
                     p_min: Optional[float] = None) -> list[str]:
    """llama-server's speculative flags for a method. `depth` (tokens drafted a pass), `lookup`
    (tokens matched, n-gram types) and `p_min` (a model drafter stops where its own top probability
    falls below it) are passed only when given: unset, llama.cpp's own defaults hold."""
    if p_min is not None and method not in DRAFT_TYPES:
        raise BackendError(f"p_min applies to a model drafter ({', '.join(DRAFT_TYPES)}), not method '{method}'")
    if method == "none":
        return []
    if method == "ngram":
        if ngram_type not in NGRAM_SIZE_FLAGS:
            raise BackendError(f"unknown llama.cpp n-gram type {ngram_type!r} ({', '.join(NGRAM_SIZE_FLAGS)})")
        lookup_flag, depth_flag = NGRAM_SIZE_FLAGS[ngram_type]
        args = ["--spec-type", ngram_type]
        if lookup is not None and lookup_flag:
            args += [lookup_flag, str(lookup)]
        if depth is not None and depth_flag:
            args += [depth_flag, str(depth)]
            if ngram_type == "ngram-mod":
                args += ["--spec-ngram-mod-n-min", "1"]  # its default (48) is above small depths
        return args
    if method in DRAFT_TYPES:
        if method == "mtp" and drafter is None:
            args = ["--spec-type", "draft-mtp"]  # the target's own MTP (nextn) layers
        elif drafter is None or Path(drafter).suffix.lower() != ".gguf":
            raise BackendError(f"llama-server's {method} drafter must be a GGUF file")
        else:
            args = ["--spec-type", DRAFT_TYPES[method], "-md", str(drafter)]
        if depth is not None:
            args += ["--spec-draft-n-max", str(depth), "--spec-draft-n-min", "0"]
        if p_min is not None:
            args += ["--spec-draft-p-min", f"{p_min:g}"]
        return args
    raise BackendError(f"llama-server runs method {', '.join(METHODS[1:])}, not '{method}'")


def spec_label(args: Sequence[str]) -> str:
    """What the arguments make the server run, for lists and status bars (`ngram-mod`, `draft-simple ×8`)."""
    args = list(args)
    if "--spec-type" in args[:-1]:
        label = args[args.index("--spec-type") + 1]
    elif any(a in ("-md", "--model-draft", "--spec-draft-model") for a in args):
        label = "draft-simple"
    else:
        return "target-only"
    for flag in ("--spec-draft-n-max", *(depth for _, depth in NGRAM_SIZE_FLAGS.values() if depth)):
        if flag in args[:-1]:
            label += f" ×{args[args.index(flag) + 1]}"
            break
    return label


def server_args(model: Path, alias: str, context: int, threads: int, *, spec: Sequence[str] = (),
                extra: Sequence[str] = (), repack: bool = True, slots: int = 1) -> list[str]:
    """The full command line after the binary (the host and port are the process's to add)."""
    # `slots` requests at once (one unless asked: verify --concurrency), each with the whole context
    # (llama-server splits -c over its slots), the counters `/metrics` reads, the GGUF's own chat
    # template, and flash attention off as in llama-cpp-python (the `llamacpp` backend), whose
    # target-only replies are then the server's token for token (`extra` may turn it back on).
    args = ["-m", str(model), "--alias", alias, "-c", str(context * slots), "-np", str(slots), "--metrics",
            "--no-webui", "--jinja", "-fa", "off"]
    if threads:
        args += ["-t", str(threads)]
    if not repack:
        args.append("--no-repack")  # see backends/llamacpp.py: extra_buffers_work
    return args + list(spec) + list(extra)
