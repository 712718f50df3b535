import json
from pathlib import Path

import pytest

from specchat.profiles import ProfileError
from specchat.prompts import load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec-bench" / "question.jsonl"
TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train-prompts"


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="shared data not present")
def test_spec_bench_limit_spreads_over_the_six_subtasks():
    items = load_prompts(SPEC_BENCH, limit=24)
    assert len(items) == 24
    tasks = {i.task for i in items}
    assert tasks == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert all(sum(i.task == t for i in items) == 4 for t in tasks)


@pytest.mark.skipif(not TRAIN.exists(), reason="shared data not present")
def test_self_instruct_records():
    items = load_prompts(TRAIN / "self-instruct-seed_tasks.jsonl")
    assert len(items) == 175 and all(i.first for i in items)


def test_plain_text_and_bad_json(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert [i.first for i in load_prompts(tmp_path / "p.txt")] == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "ok"}) + "\n{nope\n")
    with pytest.raises(ProfileError, match="bad.jsonl:2: not valid JSON"):
        load_prompts(tmp_path / "bad.jsonl")
