"""The transformers reference backend: the same checkpoint through transformers' own model.

It exists to be compared against (logits parity in tests, a row in `specchat bench`), so it
does the plain thing: `AutoModelForCausalLM` and a per-token loop with `past_key_values`,
sampled with the same position-keyed sampler as the torch engine. A GGUF is dequantized to
float32 by transformers' own GGUF converter.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .base import Backend, BackendError, Event, Request, Sampling, decode_stream
from .cpu import thread_count
from .native import sampling as sampler
from .native.tokenizer import ChatTokenizer


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model for a model directory or a GGUF file (without needing accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise BackendError(f"{path}: transformers could not map tensors {missing[:3]} from this GGUF")
    return model.to(dtype).eval()


def cache_kwargs(out) -> dict:
    """transformers 5.x names the KV cache `cache`; 4.x called it `past_key_values`."""
    return {"cache": out["cache"]} if "cache" in out else {"past_key_values": out.past_key_values}


class TransformersBackend(Backend):
    name = "transformers"

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", threads: int = 0, context: int = 2048,
                 cache_dir: Path | None = None):
        path = Path(model_path)
        torch.set_num_threads(thread_count(threads))
        self.model = load_hf_model(path, getattr(torch, dtype))
        self.tokenizer = ChatTokenizer(path, cache_dir)
        self.eos_ids = self.tokenizer.eos_ids
        self._context = context

    @property
    def context_length(self) -> int:
        return self._context

    def tokenize_chat(self, messages) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        if request.constraint is not None:
            raise BackendError("the transformers reference decodes without constraints; leave out --transformers "
                               "when a JSON schema, regex or grammar is on")
        prompt = self.checked_prompt(request)

        @torch.inference_mode()
        def tokens() -> Iterator[int]:
            out = self.model(torch.tensor([prompt]), use_cache=True)
            pos = len(prompt)
            while True:
                token = int(sampler.sample(out.logits[0, -1:].float(), [pos], sampling)[0])
                yield token
                out = self.model(torch.tensor([[token]]), **cache_kwargs(out), use_cache=True)
                pos += 1

        return decode_stream(tokens(), prompt_tokens=len(prompt), sampling=sampling, context_length=self._context,
                             is_eos=self.eos_ids.__contains__, detokenize=self.detokenize, cancel=cancel)
