"""Speculative decoding on the torch engine: one loop, many drafters.

    loop.py        the one speculative loop: a drafter proposes, the target verifies in one pass, both roll back
    acceptance.py  which drafts are kept: exact (seed-identical to target-only) or rejection sampling
    gate.py        draft from a source only while its passes pay
    drafters.py    prompt lookup, suffix decoding, a draft model, either free drafter in front of a model drafter
    ngram.py       the n-gram index behind prompt lookup
    suffix.py      the suffix index behind suffix decoding (the conversation, and a memory of earlier replies)
    mtp.py         the MTP drafter and the bookkeeping every head drafter shares (HeadDrafter)
    eagle3.py      the EAGLE-3 drafter (the head itself: native/eagle3.py)
    dflash.py      the DFlash block drafter: its model, loader and drafter
    dspark.py      DSpark: DFlash's drafter with a low-rank Markov head chained through the block
    backend.py     SpeculativeBackend (a Backend whose stream is the loop) and SpeculativeSettings

A drafter only proposes (`Drafter.propose` / `commit` in loop.py); verification, acceptance and
rollback happen in the loop, for every drafter alike.
"""
