"""Which profiles run on this machine now, and for each one that does not, why: a model to download,
a GPU this machine lacks, a server that is not answering, or a broken file.

Everything here only looks: a model is checked in the cache (never fetched), a server is asked
`GET /models` with a short timeout, every server at once, so listing all profiles stays fast.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from specchat.backends.base import BackendError
from specchat.models import NAMED_MODELS, cached_path, resolve_model
from specchat.profiles import DEFAULT_PROFILE, Profile, ProfileSet

PROBE_TIMEOUT_S = 0.5
# group -> heading, in the order they are listed (the ones that run first)
GROUPS = {
    "here": "runs here",
    "server": "on a server that answers",
    "download": "needs a download",
    "gpu": "needs a GPU",
    "needs-server": "needs a server",
    "broken": "broken",
}
CHOOSABLE = ("here", "server", "download")  # download: loading fetches the model first
COLOURS = {"here": "green", "server": "green", "download": "yellow"}  # the others: red
CHECKING = "checking whether the server answers…"


@dataclass(frozen=True)
class Availability:
    name: str
    group: str  # a key of GROUPS
    reason: str = ""  # why it is in that group ("" for one that runs here)
    profile: Optional[Profile] = None  # None for a broken one

    @property
    def heading(self) -> str:
        return GROUPS[self.group]

    @property
    def colour(self) -> str:
        return COLOURS.get(self.group, "red")

    @property
    def choosable(self) -> bool:
        """Loading it can work now (perhaps after a download)."""
        return self.group in CHOOSABLE


@dataclass(frozen=True)
class Probe:
    answered: bool
    detail: str = ""  # why not, or the HTTP status that was not 200
    models: tuple[str, ...] = ()  # what the server says it serves (empty: it did not say)


# ------------------------------------------------------------------------- this machine

@functools.lru_cache(maxsize=1)
def cuda_devices() -> int:
    """How many CUDA (or ROCm) devices torch sees here; torch is imported only where a driver is."""
    driver = any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))
    if not (driver or shutil.which("nvidia-smi") or "torch" in sys.modules):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def hub_cached(repo_id: str) -> bool:
    """A hub checkpoint's config and weights are in the Hugging Face cache (nothing is fetched)."""
    from huggingface_hub import try_to_load_from_cache

    def has(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)

    return has("config.json") and (has("model.safetensors") or has("model.safetensors.index.json"))


def missing_download(spec: str, base_dir: Path) -> Optional[str]:
    """What must be downloaded before a `model:` / `drafter:` value loads (the pull command of a
    named model, or a hub id), or None when nothing. Raises BackendError for a value that cannot load at all."""
    if spec in NAMED_MODELS:
        return None if cached_path(spec).exists() else f"`specchat pull {spec}`"
    ref = resolve_model(spec, base_dir, fetch=False)
    return ref.location if ref.kind == "hub" and not hub_cached(ref.location) else None


def gpu_need(profile: Profile) -> Optional[str]:
    device = profile.device
    if not device.startswith("cuda"):
        return None
    index = int(device[5:]) if ":" in device else 0
    have = cuda_devices()
    if index < have:
        return None
    return (f"device {device}: this machine has no CUDA GPU" if not have
            else f"device {device}: this machine has {have} CUDA GPU{'s' if have > 1 else ''}")


def local_state(profile: Profile) -> tuple[str, str]:
    """(group, reason) of a profile that runs on this machine's torch or llama.cpp engine."""
    pulls: list[str] = []  # named models: their `specchat pull` command
    hub: list[str] = []  # hub ids
    try:
        for spec in (profile.model, profile.speculative.drafter):
            if spec and (what := missing_download(spec, profile.base_dir)):
                (pulls if spec in NAMED_MODELS else hub).append(what)
    except (BackendError, OSError, ValueError) as e:  # ValueError: a hub id the hub's own check refuses
        return "broken", str(e)
    broken = weights_problem(profile)
    if broken:
        return "broken", broken
    needs = " and ".join(pulls + ([" and ".join(hub) + " from the Hugging Face hub"] if hub else []))
    build = llama_server_build(profile)
    if build and build.startswith("building"):
        return "broken", build
    gpu = gpu_need(profile)
    if gpu:
        return "gpu", gpu + (f" (and it needs {needs})" if needs else "")
    if needs or build:
        fetch = f"needs {needs} (loading downloads {'it' if len(pulls) + len(hub) == 1 else 'them'})" if needs else ""
        return "download", "; ".join(filter(None, [fetch, build]))
    return "here", ""


def weights_problem(profile: Profile) -> Optional[str]:
    """Why the weight files a profile would load cannot be read (a truncated download, a garbage
    header), from their headers alone; None when they read or are not on this machine yet."""
    from specchat.weight_memory import check_weight_files

    try:
        check_weight_files(profile)
    except (BackendError, OSError) as e:
        return str(e)
    return None


def llama_server_build(profile: Profile) -> Optional[str]:
    """What a llamaserver profile still needs built before it runs (None: nothing)."""
    if profile.backend != "llamaserver" or profile.server_config.binary:
        return None
    from specchat import paths
    from specchat.backends.llamaserver.build import built_server, missing_tools

    if built_server(paths.cache_dir()) is not None:
        return None
    if missing_tools():
        return f"building llama-server needs {' and '.join(missing_tools())}"
    return "loading builds llama-server from llama.cpp's source first (minutes, once)"


# ------------------------------------------------------------------------------ servers

def short_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    return parts.netloc + (parts.path if parts.path not in ("", "/v1") else "")


def probe(client, base_url: str, api_key: Optional[str]) -> Probe:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = client.get(base_url + "/models", headers=headers)
    except httpx.TimeoutException:
        return Probe(False, f"no answer within {client.timeout.connect:g}s")
    except (httpx.HTTPError, OSError) as e:
        reason = "connection refused" if "refused" in str(e).lower() else type(e).__name__
        return Probe(False, reason)
    if response.status_code != 200:
        return Probe(True, f"HTTP {response.status_code}")
    try:
        listed = response.json().get("data", [])
        models = tuple(str(m.get("id")) for m in listed if isinstance(m, dict))
    except (ValueError, AttributeError):
        models = ()
    return Probe(True, models=models)


def probe_all(servers: set[tuple[str, Optional[str]]], timeout_s: float = PROBE_TIMEOUT_S
              ) -> dict[tuple[str, Optional[str]], Probe]:
    """Ask every (base_url, api key) at once; none takes much longer than `timeout_s`, even a
    host whose name does not resolve (its thread is left behind, a daemon)."""
    import httpx

    if not servers:
        return {}
    out: dict[tuple[str, Optional[str]], Probe] = {}
    # no https server: no TLS either, so skip loading the certificate store (a tenth of a second)
    tls = any(url.startswith("https:") for url, _ in servers)
    client = httpx.Client(timeout=httpx.Timeout(timeout_s), verify=True if tls else False)
    threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, probe(client, *s)), daemon=True)
               for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 0.25)
    if all(not t.is_alive() for t in threads):
        client.close()
    return {s: out.get(s, Probe(False, f"no answer within {timeout_s:g}s")) for s in servers}


def server_key(profile: Profile) -> tuple[tuple[str, Optional[str]], Optional[str]]:
    """((base_url, api key), what is wrong before asking: an api_key_env that is not set)."""
    var = profile.server.api_key_env
    key = os.environ.get(var) if var else None
    unset = f"server.api_key_env names ${var}, which is not set: export {var}=<your key>" if var and not key else None
    return (profile.server.base_url, key), unset


def server_state(profile: Profile, answer: Optional[Probe], unprobed: str = CHECKING) -> tuple[str, str]:
    where = short_url(profile.server.base_url)
    unset = server_key(profile)[1]
    if unset:
        return "needs-server", unset
    if answer is None:
        return "needs-server", unprobed
    if not answer.answered:
        return "needs-server", f"not answering at {where} ({answer.detail})"
    if answer.detail:
        return "needs-server", f"{where} answers {answer.detail} to GET /models"
    if answer.models and profile.model not in answer.models:
        served = ", ".join(repr(m) for m in answer.models[:3])
        return "needs-server", f"{where} answers but serves {served}, not {profile.model!r}"
    return "server", f"answers at {where}"


# -------------------------------------------------------------------------------- all

def classify(ps: ProfileSet, probe_servers: bool = True, timeout_s: float = PROBE_TIMEOUT_S,
             unprobed: str = CHECKING) -> list[Availability]:
    """Every profile (broken ones too) with its group, listed group by group (GROUPS' order), by
    name within one. Without `probe_servers` a server profile needs a server, for `unprobed`."""
    remote = {n: p for n, p in ps.profiles.items() if p.remote}
    answers = probe_all({server_key(p)[0] for p in remote.values()}, timeout_s) if probe_servers else {}
    out = [Availability(n, "broken", e) for n, e in ps.errors.items()]
    for name, p in ps.profiles.items():
        group, reason = (server_state(p, answers.get(server_key(p)[0]), unprobed) if p.remote
                         else local_state(p))
        out.append(Availability(name, group, reason, p))
    order = list(GROUPS)
    return sorted(out, key=lambda a: (order.index(a.group), a.name))


def method_text(p: Profile) -> str:
    return p.method_label if p.remote or p.method == "none" else f"{p.method} (depth {p.speculative.depth})"


def as_json(ps: ProfileSet, found: list[Availability]) -> dict:
    """`specchat profiles --json`: each profile's fields with its group and reason; broken ones by error."""
    from specchat.weight_memory import weight_bytes

    by_name = {a.name: a for a in found}

    def weights(p: Profile) -> Optional[int]:  # None: not on this machine, or broken (its reason says)
        if p.remote or by_name[p.name].group == "broken":
            return None
        try:
            return weight_bytes(p)
        except (BackendError, OSError):  # past the header checks (a GGUF's metadata): the load says why
            return None
    return {"profiles": {n: {**p.model_dump(), "group": by_name[n].group, "reason": by_name[n].reason,
                             "weights_bytes": weights(p)} for n, p in ps.profiles.items()},
            "errors": ps.errors, "groups": GROUPS}


def _cell(text: str, width: int, style: str = "", pad: bool = True):
    from rich.text import Text

    cell = Text(text, style=style)
    cell.truncate(width, overflow="ellipsis", pad=pad)
    return cell


def print_listing(console, found: list[Availability], wide: bool = False) -> None:
    """Group by group (here first): name (the default marked *), method, model, and under one that
    does not run here, why. Each line fits the console, cut with …; `wide`: nothing is cut, and
    each profile's description follows (wrapped)."""
    from rich.cells import cell_len
    from rich.text import Text

    width = console.width
    rows = [(a, a.name + (" *" if a.name == DEFAULT_PROFILE else ""),
             method_text(a.profile) if a.profile else "", a.profile.model if a.profile else "") for a in found]
    widest = [max((cell_len(r[i]) for r in rows), default=0) for i in (1, 2, 3)]
    if wide:
        name_w, method_w, model_w = widest[0], 0, 0
    else:
        name_w, method_w = min(widest[0], 26), min(widest[1], 20)
        model_w = max(8, min(widest[2], width - 4 - name_w - method_w))

    def row(*cells) -> None:
        line = Text.assemble(*cells)
        line.rstrip()
        console.print(line, no_wrap=not wide, crop=not wide, soft_wrap=wide)

    def columns(name: str, method: str, model: str, style: str = "") -> tuple:
        first = ("  ", _cell(name, name_w, style or "bold"), " ")
        if wide:
            return *first, Text(method, style), Text(" · ", "dim"), Text(model, style)
        return *first, _cell(method, method_w, style), " ", _cell(model, model_w, style)

    row(*columns("profile", "method", "model", "dim"))
    group = None
    for a, name, method, model in rows:
        if a.group != group:
            group = a.group
            console.print(Text(a.heading, style=f"bold {a.colour}"))
        row(*columns(name, method, model))
        notes = [(a.reason, "red" if a.group == "broken" else "dim" if a.group == "server" else "")]
        if wide and a.profile and a.profile.description:
            notes.append((a.profile.description, "italic dim"))
        for text, style in notes:
            if not text:
                continue
            if a.profile is None and not wide:
                text = re.sub(r"^\S*/([^/\s]+\.ya?ml): ", r"\1: ", text)  # the file's name, not its whole path
            if wide:
                for line in Text(text, style=style).wrap(console, max(20, width - 6)):
                    row("      ", line)
            else:
                row("    ", _cell(text, width - 4, style, pad=False))
    hint = "* the default · --wide: descriptions, nothing cut · --json: for scripts"
    row(_cell(hint, len(hint) if wide else width, "dim", pad=False))
