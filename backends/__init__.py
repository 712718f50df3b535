"""Engines behind one streaming interface (see `backends.base`)."""

from .base import (Backend, BackendError, Event, Request, Sampling, Step, Summary,
                   run_to_summary)

__all__ = ["Backend", "BackendError", "Event", "Request", "Sampling", "Step", "Summary", "run_to_summary"]
