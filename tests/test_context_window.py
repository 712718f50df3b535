"""What the model sees of a conversation that outgrows its context (specchat/context_window.py)."""
import pytest

from specchat.backends.base import BackendError
from specchat.context_window import fit_window, reply_room


def count(messages):  # one token per word, plus one per message for the template
    return sum(len(m["content"].split()) + 1 for m in messages)


def turns(n, words=9):
    out = []
    for i in range(n):
        out += [{"role": "user", "content": " ".join([f"q{i}"] * words)},
                {"role": "assistant", "content": " ".join([f"a{i}"] * words)}]
    return out[:-1]  # ends with the new user turn


SYSTEM = [{"role": "system", "content": "be brief"}]


def test_a_conversation_that_fits_is_sent_whole():
    w = fit_window(count, SYSTEM, turns(3), 0, context=200, max_tokens=50)
    assert (w.start, w.dropped, w.prompt_tokens) == (0, 0, count(SYSTEM + turns(3)))
    assert w.note(200) is None


def test_the_oldest_turns_go_first_and_deep_enough_for_the_next_turns():
    history = turns(10)  # 19 messages of 10 tokens, 193 with the system prompt
    context, max_tokens = 160, 40  # room for a 40-token reply: at most 120 prompt tokens
    w = fit_window(count, SYSTEM, history, 0, context, max_tokens)
    assert history[w.start]["role"] == "user"  # a cut keeps turns whole
    assert w.prompt_tokens <= (context - reply_room(context, max_tokens)) // 2  # half the room left free
    assert w.dropped == w.start and w.dropped_tokens == count(SYSTEM + history) - w.prompt_tokens
    shallower = count(SYSTEM + history[w.start - 2:])
    assert shallower > 60  # the shallowest such cut: one turn less would not leave half free
    assert "the oldest" in w.note(context) and "history keeps them" in w.note(context)
    # the next turn starts where this one did: the model's view keeps its prefix
    grown = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    again = fit_window(count, SYSTEM, grown, w.start, context, max_tokens)
    assert again.start == w.start and again.dropped == 0


def test_a_message_that_alone_does_not_fit_is_refused_with_the_numbers():
    history = turns(2) + [{"role": "assistant", "content": "x"}, {"role": "user", "content": " ".join(["w"] * 200)}]
    with pytest.raises(BackendError, match=r"this message is 204 tokens .* 256-token context keeps 64 for the reply"):
        fit_window(count, SYSTEM, history, 0, context=256, max_tokens=100)


def test_policy_refuse_says_what_to_do_instead_of_dropping():
    with pytest.raises(BackendError, match="context_policy: drop_oldest"):
        fit_window(count, SYSTEM, turns(10), 0, context=160, max_tokens=40, policy="refuse")


def test_the_reply_room_is_the_reply_budget_at_most_a_quarter_of_the_context():
    assert reply_room(1024, 256) == 256 and reply_room(1024, 512) == 256 and reply_room(1024, 10) == 10


def test_a_backend_that_cannot_count_sends_everything():
    def no_tokenizer(messages):
        raise BackendError("the server offers no tokenizer")
    w = fit_window(no_tokenizer, SYSTEM, turns(10), 0, context=16, max_tokens=4)
    assert (w.start, w.prompt_tokens, w.dropped) == (0, None, 0)
