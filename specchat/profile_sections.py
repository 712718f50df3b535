"""The sections of a profile (`sampling:`, `speculative:`, `server:`, `llama_server:`), each
validated on its own so a problem names its key (see profiles.py for the whole profile)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

METHODS = ("none", "draft", "ngram", "suffix", "mtp", "dflash", "replayssm", "eagle3", "dspark")
# what a `backend: llamaserver` profile runs (backends/llamaserver/flags.py: onto llama.cpp's --spec-type)
LLAMASERVER_METHODS = ("none", "ngram", "draft", "mtp", "eagle3", "dflash", "dspark")
MODEL_DRAFTERS = ("draft", "mtp", "dflash", "dspark", "replayssm", "eagle3")  # the methods `lookup` can sit in front of


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(Strict):
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int = Field(0, ge=0)
    max_tokens: int = Field(512, ge=1)


class SuffixConfig(Strict):
    """Suffix decoding (backends/speculative/suffix.py): for method suffix, or in front of a model drafter."""

    # in front of a model drafter (draft, mtp, dflash, eagle3): suffix decoding proposes first, up to this
    # many tokens; the model drafter guesses when it has nothing confident. 0: off (method suffix: unused)
    first: int = Field(0, ge=0, le=64)
    min_prob: float = Field(0.1, ge=0.0, le=1.0)  # stop drafting where a token's estimated probability falls below
    factor: float = Field(1.0, gt=0.0, le=16.0)  # at most this many draft tokens per matched token
    max_match: int = Field(24, ge=8, le=256)  # the longest tail matched
    # remember earlier replies across conversations: read from the history database when the chat loads
    # (the newest first, up to `history_replies` replies and `history_tokens` tokens) and grown as replies finish
    history: bool = True
    history_replies: int = Field(1000, ge=1)
    history_tokens: int = Field(200_000, ge=100)


class SpeculativeConfig(Strict):
    method: Literal[METHODS] = "none"
    depth: int = Field(4, ge=1, le=64)
    drafter: Optional[str] = None
    acceptance: Literal["exact", "rejection"] = "exact"
    ngram_max: int = Field(3, ge=1, le=16)
    ngram_min: int = Field(1, ge=1, le=16)
    # draft, mtp, dflash, eagle3: try prompt lookup first (n-gram sizes ngram_max..ngram_min) and propose up
    # to this many tokens that followed the match; the model drafter guesses when nothing matches. 0: off
    lookup: int = Field(0, ge=0, le=64)
    # prompt lookup (method ngram, or `lookup`): once the reply copies (the last 8 tokens appeared
    # together earlier), propose up to this many tokens that followed, at most one fewer than the
    # match is long, instead of `depth` (or `lookup`). 0: off
    copy_depth: int = Field(0, ge=0, le=64)
    # Verify with exactly the arithmetic of target-only decoding (row by row): true requires it,
    # false turns it off, auto (unset) uses it where the kernels make it possible.
    strict: Optional[bool] = None
    # Draft only where it pays: pause a drafter (or the lookup or model half of `lookup`) while its
    # drafted passes bring fewer tokens per second than plain ones, retrying now and then. The
    # output is the same either way; false drafts on every pass (as `specchat ladder` measures).
    adaptive: bool = True
    # MTP: which target hidden state feeds the head (post_norm: after the final norm, as the
    # reference implementations do; pre_norm: the last layer's output). Unset: what the head's
    # config says, else post_norm.
    mtp_hidden: Optional[Literal["post_norm", "pre_norm"]] = None
    # Hybrid (linear-attention) targets: how their recurrent state returns to the accepted prefix
    # after a verify block: keep the state after every row (snapshot) or one checkpoint and the
    # block's inputs, replayed (replay, ReplaySSM). auto: the cheaper on the device (docs/results.md).
    rollback: Literal["auto", "snapshot", "replay"] = "auto"
    suffix: SuffixConfig = SuffixConfig()

    @property
    def suffix_drafts(self) -> bool:
        """Whether suffix decoding drafts (alone or in front of a model drafter)."""
        return self.method == "suffix" or bool(self.suffix.first)

    @model_validator(mode="after")
    def _check(self):
        if self.method == "draft" and not self.drafter:
            raise ValueError("method 'draft' needs `drafter`: a GGUF file or model directory")
        if self.method == "replayssm" and not self.drafter:
            raise ValueError("method 'replayssm' needs `drafter`: a recurrent draft model directory "
                             "(e.g. made by `specchat train replayssm`)")
        if self.method == "dflash" and not self.drafter:
            raise ValueError("method 'dflash' needs `drafter`: a DFlash drafter directory")
        if self.method == "dspark" and not self.drafter:
            raise ValueError("method 'dspark' needs `drafter`: a DSpark drafter directory (on llama-server also "
                             "a GGUF file in llama.cpp's dflash layout with a Markov head)")
        if self.method == "eagle3" and not self.drafter:
            raise ValueError("method 'eagle3' needs `drafter`: an EAGLE-3 head directory (a public head, "
                             "or one made by `specchat train eagle3`)")
        if self.lookup and self.method not in MODEL_DRAFTERS:
            raise ValueError(f"`lookup` puts prompt lookup in front of a model drafter ({', '.join(MODEL_DRAFTERS)}); "
                             f"method '{self.method}' has none (for prompt lookup alone use method: ngram)")
        if self.suffix.first and self.method not in MODEL_DRAFTERS:
            raise ValueError(f"`suffix.first` puts suffix decoding in front of a model drafter ({', '.join(MODEL_DRAFTERS)}); "
                             f"method '{self.method}' has none (for suffix decoding alone use method: suffix)")
        if self.suffix.first and self.lookup:
            raise ValueError("set either `lookup` or `suffix.first` in front of the model drafter, not both "
                             "(suffix decoding also drafts from the conversation, as prompt lookup does)")
        if self.copy_depth and self.method != "ngram" and not self.lookup:
            raise ValueError("`copy_depth` lengthens prompt-lookup drafts: it needs method 'ngram', or `lookup` "
                             "in front of a model drafter")
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        return self


class ServerConfig(Strict):
    """Where a `backend: openai` profile's model runs: any OpenAI-compatible server."""

    base_url: str  # the OpenAI-compatible root, e.g. http://127.0.0.1:8000/v1
    api_key_env: Optional[str] = None  # the environment variable that holds the key (never the key itself)
    timeout_s: float = Field(60.0, gt=0)  # for connecting, and for the server to send the next chunk
    metrics: Literal["auto", "vllm", "sglang", "llama-server", "none"] = "auto"
    logprobs: bool = True  # ask for per-token logprobs (token ids where the server gives them)
    stream: bool = True  # false: whole replies (SGLang reports its verify count only on those)
    speculation: Optional[str] = None  # what the server runs, for display, e.g. "dflash, 15 tokens"

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("expected an http(s) URL such as http://127.0.0.1:8000/v1")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.replace("_", "a").isalnum():
            raise ValueError("expected the NAME of an environment variable (e.g. VLLM_API_KEY), not the key")
        return v


class ConstraintConfig(Strict):
    """The shape every reply keeps (specchat/constraints.py): one of a JSON schema file, a regular
    expression or a grammar file (Lark, or llama.cpp's GBNF); files relative to the profile's folder."""

    json_schema: Optional[str] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None

    @model_validator(mode="after")
    def _one(self):
        if len([k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]) != 1:
            raise ValueError("give exactly one of json_schema (a file), regex or grammar (a file)")
        return self

    @property
    def chosen(self) -> tuple[str, str]:
        """(kind, value) of the one set."""
        return next((k, getattr(self, k)) for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None)


NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


class LlamaServerConfig(Strict):
    """How a `backend: llamaserver` profile runs the llama-server specchat starts for it."""

    binary: Optional[str] = None  # your own llama-server build; unset: specchat builds one (once)
    ngram_type: Literal[NGRAM_TYPES] = "ngram-simple"  # what llama.cpp runs for method ngram
    args: list[str] = []  # more llama-server arguments, for the speculative run and its reference alike
    spec_args: list[str] = []  # more speculative arguments (with a method), e.g. [--spec-draft-n-min, "2"]
    # a model drafter (draft, mtp, eagle3, dflash, dspark) drafts only while its own top probability is at
    # least this (--spec-draft-p-min); unset: llama.cpp's default (0, always)
    p_min: Optional[float] = Field(None, ge=0.0, le=1.0)
    port: Optional[int] = Field(None, ge=1, le=65535)  # unset: a free loopback port
    startup_timeout_s: float = Field(120.0, gt=0)
    timeout_s: float = Field(60.0, gt=0)  # for the server to send the next chunk
    slots: int = Field(1, ge=1, le=64)  # requests served at once (-np), each with the whole context

    @field_validator("args", "spec_args")
    @classmethod
    def _no_owned(cls, v: list[str]) -> list[str]:
        owned = {"-m", "--model", "--host", "--port", "-c", "--ctx-size", "--alias", "-a", "-np", "--parallel"} & set(v)
        if owned:
            raise ValueError(f"{', '.join(sorted(owned))}: specchat sets these from model, context, slots and "
                             "its own port; leave them out")
        return v
