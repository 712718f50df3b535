"""The device check behind scripts/gpu_check.sh: what the engine does on a CUDA machine, proven
and measured in one run of a few minutes (docs/gpu-check.md).

    plan.py         what runs where: the CUDA plan, the CPU plan (--cpu), time budgets
    budget.py       the whole check's clock and each part's share of it
    tree.py         the engine and the test helpers imported from this working tree, installed or not
    checkpoints.py  the tiny random checkpoints (the test suite's own writers)
    judge.py        a speculative reply against target-only: identical, near-tie or mismatch
    logits.py       part 1: logits against transformers, every architecture and precision
    parity.py       part 2: the speculative parity grid (every drafter, greedy and seeded sampling)
    compiled.py     part 3: compile=True against eager
    shapes.py       random-weight models of real shapes, built on the device
    speed.py        part 4: decode speed, bandwidth bound, verify-block cost, loop overhead
    report.py       report.json and summary.txt
"""
