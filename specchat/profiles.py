"""Profiles: one YAML file = model + backend + method + sampling, switchable in one keystroke.

Shipped profiles live in the `profiles/` package; user profiles in the user config directory
add to them or override them by name. A profile may `extends:` another and override fields.
Every problem becomes one line naming the file, the key and what is expected; a broken
profile never stops the others from loading.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from specchat import paths
from specchat.profile_sections import (LLAMASERVER_METHODS, ConstraintConfig, LlamaServerConfig, SamplingConfig,
                                       ServerConfig, SpeculativeConfig, Strict)

# The fastest lossless profile here (docs/results.md, "the default profile"): compiled decode graphs,
# prepared in the background on a first start, with prompt lookup verified strictly. `smollm2`
# stays the same model target-only, the reference A/B and verify compare against.
DEFAULT_PROFILE = "smollm2-fast"


class ProfileError(Exception):
    """One clear line: which file, which key, what is expected."""


# Profiles built in memory for this process (`-m FILE`: specchat/model_flag.py), found by name as the
# files' are (the chat, its picker, the REPL); never written anywhere.
_SESSION: dict[str, "Profile"] = {}


def add_session_profile(profile: "Profile") -> None:
    _SESSION[profile.name] = profile


def clear_session_profiles() -> None:
    _SESSION.clear()


class Profile(Strict):
    name: str
    description: str = ""
    extends: Optional[str] = None
    backend: Literal["torch", "llamacpp", "llamaserver", "openai"] = "torch"
    model: str
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int4"] = "auto"  # int4: 4-bit layers on CPU
    device: str = "auto"
    threads: int = Field(0, ge=0)  # 0: all physical cores
    context: int = Field(2048, ge=16)
    # a conversation that outgrows `context`: leave out its oldest turns (drop_oldest) or refuse the turn
    context_policy: Literal["drop_oldest", "refuse"] = "drop_oldest"
    compile: bool = False  # torch: torch.compile the decode passes (CPU: int4/bfloat16; first start compiles)
    system: Optional[str] = None
    sampling: SamplingConfig = SamplingConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    server: Optional[ServerConfig] = None  # backend openai only
    llama_server: Optional[LlamaServerConfig] = None  # backend llamaserver only
    constraint: Optional[ConstraintConfig] = None  # the shape every reply keeps (a JSON schema, regex, grammar)
    # write this profile's prompts and replies to the history database (chat, REPL and `run`); false:
    # nothing is written, and a suffix drafter's memory reads nothing from it either
    history: bool = True
    source: Optional[str] = Field(None, exclude=True)  # the file it came from

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("expected auto, cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _combination(self):
        if self.backend == "llamacpp" and self.speculative.method != "none":
            raise ValueError(
                f"speculative method '{self.speculative.method}' needs backend 'torch' "
                "(the llama.cpp backend runs target-only)")
        if self.backend == "openai":
            if self.server is None:
                raise ValueError("backend 'openai' needs a `server:` section with at least base_url")
            if self.speculative.method != "none":
                raise ValueError("a remote server speculates on its own: describe it in server.speculation "
                                 "and leave speculative.method unset")
        elif self.server is not None:
            raise ValueError("`server:` is only for backend 'openai'")
        if self.backend == "llamaserver":
            self._llamaserver_combination()
        elif self.llama_server is not None:
            raise ValueError("`llama_server:` is only for backend 'llamaserver'")
        return self

    def _llamaserver_combination(self) -> None:
        spec, config = self.speculative, self.server_config
        if spec.method not in LLAMASERVER_METHODS:
            raise ValueError(f"llama-server runs method {', '.join(LLAMASERVER_METHODS[1:])}, not '{spec.method}': "
                             "use backend torch for it")
        if config.spec_args and spec.method == "none":
            raise ValueError("llama_server.spec_args add to a speculative method: set speculative.method")
        if config.p_min is not None and spec.method in ("none", "ngram"):
            raise ValueError("llama_server.p_min stops a model drafter's draft early: it needs method draft, mtp, "
                             "eagle3, dflash or dspark")
        if spec.lookup or spec.suffix.first:
            raise ValueError("`lookup` and `suffix.first` are specchat's own loop; llama-server drafts with its "
                             "method alone: leave them out")

    @property
    def remote(self) -> bool:
        return self.backend == "openai"

    @property
    def method_label(self) -> str:
        """How this profile decodes, for lists and status bars."""
        if self.remote:
            return f"server: {self.server.speculation}" if self.server.speculation else "server-side"
        if self.backend == "llamaserver" and self.method != "none":
            kind = (self.server_config.ngram_type if self.method == "ngram" else
                    "draft-simple" if self.method == "draft" else f"draft-{self.method}")
            return f"llama.cpp {kind} d={self.speculative.depth}"
        if self.method == "none":
            return "target-only"
        first = f" +suffix:{self.speculative.suffix.first}" if self.speculative.suffix.first else ""
        return f"{self.method} d={self.speculative.depth}{first}"

    @property
    def server_config(self) -> LlamaServerConfig:
        """A llamaserver profile's `llama_server:` section (its defaults when the profile has none)."""
        return self.llama_server or LlamaServerConfig()

    @property
    def method(self) -> str:
        return self.speculative.method

    @property
    def base_dir(self) -> Path:
        return Path(self.source).parent if self.source else Path.cwd()

    def resolve_path(self, value: str) -> Path:
        """A path written in a profile is relative to the profile's own file."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)

    def target_only(self) -> "Profile":
        """The same profile with speculation off: the reference a speculative run is checked against."""
        if self.remote:
            raise ProfileError(
                f"profile '{self.name}' runs on a server, whose speculation specchat cannot switch off: name a "
                "reference profile (-r), e.g. the same model served without speculation, or a local one")
        update = {"name": f"{self.name}:target-only", "speculative": SpeculativeConfig()}
        if self.llama_server is not None:
            update["llama_server"] = self.llama_server.model_copy(update={"spec_args": [], "p_min": None, "port": None})
        return self.model_copy(update=update)

    def with_overrides(self, settings: dict[str, Any] | None = None, **sampling: Any) -> "Profile":
        """A copy with some fields changed, validated like a file: `settings` maps dotted keys
        (`dtype`, `speculative.depth`, …) to values; keyword arguments are sampling fields.
        None values are ignored."""
        data = self.model_dump(exclude={"source"})
        changes = {f"sampling.{k}": v for k, v in sampling.items()}
        changes.update(settings or {})
        for key, value in changes.items():
            if value is None:
                continue
            *path, leaf = key.split(".")
            node = data
            for part in path:
                if not isinstance(node.get(part), dict):
                    raise ProfileError(f"profile '{self.name}': {key}: unknown key")
                node = node[part]
            if leaf not in node:
                raise ProfileError(f"profile '{self.name}': {key}: unknown key")
            node[leaf] = value
        try:
            return Profile(**data, source=self.source)
        except ValidationError as e:
            raise ProfileError(_one_line(e, f"profile '{self.name}'")) from None


def _one_line(err: ValidationError, where: str, section: tuple[str, ...] = ()) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in (*section, *first["loc"])) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; see `specchat profiles --help`)"
    elif first["type"] == "missing":
        msg = "required key is missing"
    elif "input" in first and first["type"] not in ("value_error",):
        msg = f"{msg} (got {first['input']!r})"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{where}: {loc}: {msg}{more}"


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ProfileError(f"{path}: broken YAML{at}: {problem}") from None
    except OSError as e:
        raise ProfileError(f"{path}: cannot read: {e.strerror}") from None
    if data is None:
        raise ProfileError(f"{path}: the file is empty; expected a mapping with at least `model:`")
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of keys (name, model, backend, ...), got {type(data).__name__}")
    return data


@dataclass
class ProfileSet:
    profiles: dict[str, Profile]
    errors: dict[str, str]  # profile name -> one-line error

    def get(self, name: str) -> Profile:
        if name in self.profiles:
            return self.profiles[name]
        if name in self.errors:
            raise ProfileError(self.errors[name])
        path = Path(name)
        if path.suffix in (".yaml", ".yml") and path.exists():
            return load_profile_file(path)
        known = ", ".join(sorted(self.profiles)) or "none"
        raise ProfileError(f"no profile named '{name}' (available: {known}); `specchat profiles` lists them")


def _profile_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for folder in (paths.shipped_profiles_dir(), paths.user_profiles_dir()):
        for f in sorted(folder.glob("*.y*ml")):
            files[f.stem] = f  # user files come second and override shipped ones
    return files


def _resolve(name: str, files: dict[str, Path], raw: dict[str, dict], chain: tuple[str, ...] = ()) -> dict:
    if name in chain:
        raise ProfileError(f"{files[chain[0]]}: extends: cycle {' -> '.join(chain + (name,))}")
    data = raw[name]
    parent = data.get("extends")
    if parent is None:
        return data
    if not isinstance(parent, str) or parent not in files:
        raise ProfileError(f"{files[name]}: extends: no profile named {parent!r} to extend")
    if parent not in raw:
        raise ProfileError(f"{files[name]}: extends: parent profile '{parent}' is itself broken")
    inherited = {k: v for k, v in _resolve(parent, files, raw, chain + (name,)).items()
                 if k not in ("name", "description")}
    return _deep_merge(_anchor_paths(inherited, files[parent].parent), data)


def _anchor_paths(data: dict, folder: Path) -> dict:
    """Relative model / drafter paths made absolute from the folder of the file that wrote them,
    so that a profile extending a shipped one (from another folder) finds the same files."""
    from specchat.models import looks_like_path

    def anchored(value):
        if isinstance(value, str) and looks_like_path(value) and not value.startswith(("/", "~")):
            return str((folder / value).resolve())
        return value

    out = dict(data, model=anchored(data.get("model"))) if "model" in data else dict(data)
    if isinstance(out.get("speculative"), dict) and "drafter" in out["speculative"]:
        out["speculative"] = dict(out["speculative"], drafter=anchored(out["speculative"]["drafter"]))
    constraint = out.get("constraint")
    if isinstance(constraint, dict):  # its files, never its regex
        out["constraint"] = {k: (str((folder / v).expanduser()) if k != "regex" and isinstance(v, str)
                                 and not v.startswith(("/", "~")) else v) for k, v in constraint.items()}
    return out


def _build(name: str, data: dict, path: Path) -> Profile:
    data = dict(data)
    if data.setdefault("name", name) != name:
        raise ProfileError(f"{path}: name: {data['name']!r} differs from the file name; "
                           f"a profile is named by its file ({name})")
    data.pop("extends", None)
    try:
        profile = Profile(**data, source=str(path))
    except ValidationError as e:
        raise ProfileError(_one_line(e, str(path))) from None
    except TypeError as e:
        raise ProfileError(f"{path}: {e}") from None
    _check_files(profile, path)
    return profile


def _check_files(profile: Profile, path: Path) -> None:
    from specchat.models import looks_like_path

    if profile.remote:
        return  # the model is a name the server serves; nothing on this machine to check
    if looks_like_path(profile.model) and not profile.resolve_path(profile.model).exists():
        raise ProfileError(f"{path}: model: no file or directory at {profile.resolve_path(profile.model)}")
    drafter = profile.speculative.drafter
    if drafter and looks_like_path(drafter) and not profile.resolve_path(drafter).exists():
        raise ProfileError(
            f"{path}: speculative.drafter: no drafter at {profile.resolve_path(drafter)} "
            "(train one with `specchat train`, or point `drafter:` at a model directory or GGUF file)")


def load_profile_file(path: Path) -> Profile:
    """A profile given by its file (`-p path/to/x.yaml`); its `extends:` names a profile beside it,
    a user profile or a shipped one (the closest wins), and only that chain is read."""
    files = _profile_files()
    files.update({f.stem: f for f in sorted(path.parent.glob("*.y*ml"))})
    name = path.stem
    files[name] = path
    raw = {name: _read_yaml(path)}
    parent = raw[name].get("extends")
    while isinstance(parent, str) and parent in files and parent not in raw:
        try:
            raw[parent] = _read_yaml(files[parent])
        except ProfileError:
            break  # _resolve says the parent is broken
        parent = raw[parent].get("extends")
    return _build(name, _resolve(name, files, raw), path)


def load_profiles() -> ProfileSet:
    files = _profile_files()
    raw: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for name, path in files.items():
        try:
            raw[name] = _read_yaml(path)
        except ProfileError as e:
            errors[name] = str(e)
    profiles: dict[str, Profile] = {}
    for name in raw:
        try:
            profiles[name] = _build(name, _resolve(name, files, raw), files[name])
        except ProfileError as e:
            errors[name] = str(e)
    for name, profile in _SESSION.items():
        profiles[name] = profile
        errors.pop(name, None)
    return ProfileSet(profiles, errors)


def get_profile(name: str | None = None) -> Profile:
    """The profile of that name (the default profile for None), or ProfileError with one line."""
    return load_profiles().get(name or DEFAULT_PROFILE)
