"""The stages of scripts/mutation_run.py, one module each (the package runs from scripts/)."""
