"""What reading the history into a suffix drafter's memory adds to a start (`specchat run`, the
chat's load): a history database of N replies the target wrote (the kept corpus's replies, decoded),
then suffix_memory.warm timed on a fresh memory each time, median of 5; and at the profile's limits
(1,000 replies, 200,000 tokens) what it holds.

    python scripts/suffix_memory_cost.py [N ...]     (default: 10 100 1000)
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specchat import suffix_memory
from specchat.backends.speculative.backend import SpeculativeBackend, make_suffix_drafter
from specchat.backends.speculative.suffix import SuffixSettings
from specchat.history import History
from specchat.loading import load_target
from specchat.profiles import load_profiles
from specchat.train.corpus import read_corpus

CORPORA = Path(__file__).resolve().parent.parent / "profiles" / "drafters" / "corpus"

profile = load_profiles().get("smollm2-suffix")
target = load_target(profile, compile=False)
replies = []
for corpus in sorted(CORPORA.iterdir()):
    lines, tokens = read_corpus(corpus)
    for line in lines:
        start = line["offset"] + line["prompt_len"]
        replies.append(target.detokenize(tokens[start:start + line["reply_len"]].tolist()))
sx = profile.speculative.suffix
print(f"{len(replies)} target-written replies in the kept corpora")
for n in [int(a) for a in sys.argv[1:]] or [10, 100, 1000]:
    history = History(Path(tempfile.mkdtemp()) / "history.db")
    for i in range(n):
        cid = history.new_conversation(profile.name)
        history.add_message(cid, "user", "please")
        history.add_message(cid, "assistant", replies[i % len(replies)])
    times, line = [], ""
    for _ in range(5):
        settings = SuffixSettings(memory=True, memory_replies=sx.history_replies, memory_tokens=sx.history_tokens)
        backend = SpeculativeBackend(target, make_suffix_drafter(settings), profile.speculative.depth)
        started = time.perf_counter()
        line = suffix_memory.warm(backend, profile, history.path)
        times.append(time.perf_counter() - started)
    print(f"{n:>5} replies: {statistics.median(times) * 1000:7.1f} ms median of 5  ({line})")
