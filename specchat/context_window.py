"""What the model sees of a conversation that outgrows its context.

Policy `drop_oldest` (the default): when the next turn will not fit, the oldest turns are left out
(the system prompt and the newest user turn always stay), and the cut is made deep enough that the
following turns fit too, so that their prompts share a prefix with the cache and reuse it instead
of re-reading the conversation every turn (llama.cpp's context shift discards half for the same
reason). The cut only moves forward (`Conversation.context_start`); what is left out stays in the
conversation on screen and in history. Policy `refuse`: the turn is refused with the numbers.

A turn fits when its prompt leaves room for a reply: `max_tokens`, at most a quarter of the context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specchat.backends.base import BackendError

Count = Callable[[list[dict]], int]  # tokens of a chat prompt (the backend's own template)


@dataclass(frozen=True)
class Window:
    start: int  # index of the first conversation message the model sees
    prompt_tokens: Optional[int]  # None: the backend cannot count tokens (then nothing is left out)
    dropped: int = 0  # messages this fit newly left out
    dropped_tokens: int = 0

    def note(self, context: int) -> Optional[str]:
        """The one line that tells the user what was left out, if anything was."""
        if not self.dropped:
            return None
        what = "message" if self.dropped == 1 else "messages"
        return (f"context: the oldest {self.dropped} {what} ({self.dropped_tokens} tokens) left out so the "
                f"conversation fits the {context}-token context; history keeps them")


def reply_room(context: int, max_tokens: int) -> int:
    return max(1, min(max_tokens, context // 4))


def fit_window(count: Count, system: Sequence[dict], history: Sequence[dict], start: int, context: int,
               max_tokens: int, policy: str = "drop_oldest") -> Window:
    """Where the model's view of `history` (whose last message is the new user turn) starts.

    Raises BackendError (one line with the numbers) when even the newest user turn alone does not
    fit, or when it would take leaving turns out and `policy` is `refuse`."""
    system, history = list(system), list(history)
    room = reply_room(context, max_tokens)
    limit = context - room  # the most prompt tokens that leave room for a reply
    start = min(start, len(history) - 1)
    try:
        n = count(system + history[start:])
    except BackendError:  # a server that offers no tokenizer: it checks the length itself
        return Window(start, None)
    if n <= limit:
        return Window(start, n)
    cuts = [i for i in range(start + 1, len(history)) if history[i]["role"] == "user"]
    newest = count(system + history[-1:]) if history[-1]["role"] == "user" else n
    if newest > limit or not cuts:
        raise BackendError(
            f"this message is {newest} tokens with the system prompt, and the {context}-token context keeps "
            f"{room} for the reply: shorten it, or raise `context` (or lower `sampling.max_tokens`) in the profile")
    if policy == "refuse":
        raise BackendError(
            f"the conversation is {n} tokens and the {context}-token context keeps {room} for the reply: start a "
            f"new chat, or set `context_policy: drop_oldest` (or a larger `context`) in the profile")
    # The shallowest cut that leaves half the room free for later turns, else the shallowest that fits.
    sizes = [(i, count(system + history[i:])) for i in cuts]
    fitting = [(i, k) for i, k in sizes if k <= limit]
    roomy = [(i, k) for i, k in fitting if k <= limit // 2]
    cut, kept = (roomy or fitting)[0]
    return Window(cut, kept, dropped=cut - start, dropped_tokens=n - kept)


def fit_request(backend, profile, conv):
    """The request for the conversation's next reply (its last message is the new user turn), the
    cut moved if it must be, and the note to show (None: nothing newly left out)."""
    from specchat.backends.base import Request
    from specchat.loading import messages_for, sampling_of

    system = messages_for(profile, [], conv.system)
    window = fit_window(lambda msgs: len(backend.tokenize_chat(msgs)), system, conv.messages, conv.context_start,
                        backend.context_length, sampling_of(profile).max_tokens, profile.context_policy)
    conv.context_start = window.start
    return Request(messages=system + conv.in_context), window.note(backend.context_length)


def fit_ab_requests(spec_backend, ref_backend, spec_profile, ref_profile, conv, prompt: str):
    """The A/B view's two requests for `prompt` after the conversation, cut to fit the smaller of the
    two contexts (both sides see the same turns), and where the cut lies, for the conversation to
    take once the turn is added, and the note; the conversation itself is not changed."""
    from specchat.backends.base import Request
    from specchat.loading import messages_for, sampling_of

    history = conv.messages + [{"role": "user", "content": prompt}]
    context = min(spec_backend.context_length, ref_backend.context_length)
    window = fit_window(lambda msgs: len(spec_backend.tokenize_chat(msgs)), messages_for(spec_profile, [], conv.system),
                        history, conv.context_start, context, sampling_of(spec_profile).max_tokens,
                        spec_profile.context_policy)
    spec_req, ref_req = (Request(messages=messages_for(p, history[window.start:], conv.system))
                         for p in (spec_profile, ref_profile))
    return spec_req, ref_req, window.start, window.note(context)
