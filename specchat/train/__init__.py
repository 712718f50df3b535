"""Drafter training: distillation data from the target (`data`), a small draft model (`draft`)."""
