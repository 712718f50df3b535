"""Drafter training: distillation data from the target (`data`), a small draft model (`draft`)."""

BATCH_DTYPES = ("bfloat16", "float32")  # precisions of the batched reply generator (specchat/train/batched.py)
