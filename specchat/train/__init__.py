"""Drafter training: distillation data from the target (`data`), a small draft model (`draft`)."""

BATCH_DTYPES = ("bfloat16", "float32")  # precisions of the batched reply generator (specchat/train/batched.py)


def batched_generator(dtype: str) -> str:
    """How a data directory's replies were written by the batched model, as its info.json says."""
    return f"transformers {dtype}, batched"


def generator_dtype(generator: str) -> str:
    """The precision named by `batched_generator`'s text."""
    return generator.split()[1].rstrip(",")
