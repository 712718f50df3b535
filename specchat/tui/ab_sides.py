"""What each side of the A/B view runs, and how their replies are judged.

The left side is the speculative profile, the right its reference. Where the reference computes
with other arithmetic (another engine, backend, dtype or quantization), the speculative profile's
own target-only runs too, after both visible runs, and a divergence is told apart as `specchat
verify` tells it (verify.attribute): the drafter's, or the engines'. The floor puts the reference
on both sides (the same settings, each run from a fresh cache): whether the target reproduces
itself, before a drafter is judged against it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from specchat.backends.base import STOP_CANCELLED, Backend, BackendError, Request, Sampling, Summary, run_to_summary
from specchat.compare import IDENTICAL, Verdict, first_divergence, mark_and_colour, near_tie_margin
from specchat.live import MIN_TIMED_TOKENS, one_line, speedup_line
from specchat.loading import load_reference, same_arithmetic
from specchat.profiles import Profile, ProfileError
from specchat.verify import attribute, fresh, judge_replies, judge_target_runs, tie_margin_of, torch_engine_of

FLOOR_NOTE = "{what} vs {what}: the floor · the same settings twice, each from a fresh cache, one after the other{back}"


@dataclass
class Sides:
    spec_profile: Profile
    ref_profile: Profile
    spec_backend: Backend
    ref_backend: Backend
    # the speculative profile's own target-only where the reference computes with other arithmetic
    own_backend: Optional[Backend] = None
    own_error: Optional[str] = None  # why it did not load
    floor_only: bool = False  # both sides are one target-only profile (`ab -p P -r P`): the view is the floor
    other_engine: bool = False  # the reference computes with other arithmetic than the speculative target
    floor: bool = False  # the left side runs the reference again (Ctrl+F)

    @classmethod
    def load(cls, spec_profile: Profile, spec_backend: Backend, ref_profile: Profile,
             loader: Callable[[Profile], Backend]) -> "Sides":
        """The reference loaded (on the target's weights where it can be; raises for what the user
        can fix), and the speculative profile's own target-only where it is needed (its failure
        is kept, to be said, and leaves divergences judged directly)."""
        spec, ref = spec_profile, ref_profile
        floor_only = spec.name == ref.name or (spec.method == "none" and not spec.remote and same_arithmetic(spec, ref))
        other_engine = not floor_only and not spec.remote and not same_arithmetic(spec, ref)
        ref_backend = load_reference(spec, spec_backend, ref, loader)
        own = own_error = None
        if other_engine and spec.method != "none":  # a target-only profile is its own target-only
            try:
                own = load_reference(spec, spec_backend, spec.target_only(), loader)
            except (ProfileError, BackendError) as e:
                own_error = str(e)
            except Exception as e:
                own_error = one_line(e)
            if own_error:
                own_error = (f"{spec.name}'s own target-only failed to load ({own_error}): a divergence from "
                             f"{ref.name} cannot be told the drafter's or the engines'")
        return cls(spec, ref, spec_backend, ref_backend, own, own_error, floor_only, other_engine, floor_only)

    def close(self, keep: Optional[Backend]) -> None:
        """Close what the view loaded (never `keep`, the chat's own backend)."""
        for backend in {id(b): b for b in (self.ref_backend, self.own_backend) if b is not None}.values():
            if backend is keep or backend is self.spec_backend:
                continue
            try:
                backend.close()
            except Exception:
                pass

    @property
    def left_backend(self) -> Backend:
        """The floor by Ctrl+F runs the reference itself again; `ab -p P -r P` has P on both sides."""
        return self.ref_backend if self.floor and not self.floor_only else self.spec_backend

    def toggle_floor(self) -> tuple[str, bool]:
        """Ctrl+F: the left side runs the reference again, or the speculative profile again; what to
        say, and whether it switched (`ab -p P -r P` is the floor and stays it)."""
        ref = self.ref_profile.name
        if self.floor_only:
            return f"both sides are already {ref}: this view is the floor", False
        self.floor = not self.floor
        return (f"the next prompt runs {ref} twice, each from a fresh cache" if self.floor
                else f"the next prompt runs {self.spec_profile.name} against {ref}"), True

    # ------------------------------------------------------------------ words
    def warnings(self) -> list[str]:
        spec = self.spec_profile
        said = [self.own_error] if self.own_error else []
        if spec.method == "none" and not spec.remote and not self.floor_only:
            said.append(f"{spec.name} is not speculative: both sides decode target-only")
        return said

    def ref_title(self) -> str:
        ref = self.ref_profile
        shared = " · on the target's weights" if getattr(self.ref_backend, "shares_weights", False) else ""
        return f"reference: {ref.name} ({ref.method_label}, {ref.backend}){shared}"

    def left_title(self) -> str:
        spec, ref = self.spec_profile, self.ref_profile
        if self.floor:
            again = "" if self.floor_only else " again"
            return f"floor: {ref.name}{again} ({ref.method_label}, a fresh cache)"
        return f"speculative: {spec.name} ({spec.method_label})"

    def floor_note(self) -> str:
        return FLOOR_NOTE.format(what=self.ref_profile.method_label,
                                 back="" if self.floor_only else " (Ctrl+F: speculative)")

    def header_note(self) -> Optional[str]:
        if not self.other_engine or self.floor:
            return None
        if self.own_backend is not None:
            return (f"another engine: {self.spec_profile.name}'s own target-only runs after both, "
                    "to tell the drafter from the engines")
        return "another engine: a divergence is the engines'" if self.spec_profile.method == "none" else None

    def judging_line(self, floor: bool) -> str:
        if self.other_engine and self.own_backend is not None and not floor:
            return (f"judging… {self.spec_profile.name}'s own target-only runs now, to tell the drafter from "
                    "the engines (Esc stops it)")
        return "judging…"

    def verdict_line(self, v: Verdict, floor: bool) -> str:
        if floor and v.kind == IDENTICAL:
            return (f"reproducible: both runs gave the same {v.compared} {v.by}" if v.complete else
                    f"reproducible for the {v.compared} {v.by} both runs produced (a reply was stopped)")
        return v.line()

    def verdict_items(self, v: Verdict, left: Summary, ref: Summary, floor: bool, constraint_line: Optional[str],
                      using: Optional[str]) -> list:
        """The verdict area: the verdict in its colour, the timing, whether both replies keep the
        constraint (when one is on), and which reply the conversation continues with (`using`: None
        when the replies are identical and there is nothing to choose)."""
        mark, colour = mark_and_colour(v)
        items: list = [(f"{mark} {self.verdict_line(v, floor)}", f"bold {colour}".strip())]
        timing = self.timing_line(left, ref, floor)
        if timing:
            items.append(f"  │ {timing}")
        if constraint_line:
            items.append(f"\n{constraint_line}")
        if using is not None:
            items.append(f"\n{self.choice_line(using, floor)} · Esc: back to chat")
        else:
            items.append("\nreply added to the conversation · Esc: back to chat")
        return items

    @staticmethod
    def choice_line(using: str, floor: bool) -> str:
        """Which reply the conversation continues with (`using`: speculative or reference, the sides)."""
        left = "floor run's" if floor else "speculative"
        now, other = (left, "reference") if using == "speculative" else ("reference", left)
        return f"continuing with the {now} reply (Ctrl+L: use the {other} one)"

    @staticmethod
    def timing_line(left: Summary, ref: Summary, floor: bool) -> Optional[str]:
        return floor_timing(left, ref) if floor else speedup_line(left, ref)

    # --------------------------------------------------------------- judging
    def judge(self, ref: Summary, left: Summary, requests: tuple[Request, Request, Sampling], floor: bool,
              cancel: Optional[threading.Event] = None, gate: Optional[threading.Lock] = None) -> Verdict:
        """Token alignment with `specchat.compare` (as `specchat verify`); text when a side has no ids.
        The floor: whether the two runs agree. A reference on another engine: the drafter's part and
        the engines' told apart with the speculative profile's own target-only (verify.attribute)."""
        spec_req, ref_req, sampling = requests
        if floor:
            return self.judge_floor(ref, left)
        note = ""
        if self.other_engine:
            v, note = self._attribute(ref, left, spec_req, sampling, cancel, gate)
            if v is not None:
                return v
        backend = self.ref_backend
        tie = tie_margin_of(backend) if torch_engine_of(backend) is not None else near_tie_margin(self.ref_profile.dtype)
        v = judge_replies(backend, ref_req, ref, left, sampling, tie, other_backend=self.spec_backend)
        if note and v.kind != IDENTICAL:
            v.why = f"{v.why} · {note}" if v.why else note
        return v

    def _attribute(self, ref: Summary, spec: Summary, request: Request, sampling: Sampling,
                   cancel: Optional[threading.Event], gate: Optional[threading.Lock]) -> tuple[Optional[Verdict], str]:
        """The verdict told apart as `verify` tells it, or None and why it could not be."""
        if self.spec_profile.method == "none":  # the left side is its own target-only: no drafter to blame
            v = attribute(self.spec_backend, request, spec, spec, ref, sampling)
            if v.kind != IDENTICAL:
                v.why = "both sides decode target-only: no drafter in it"
            return v, ""
        own = self.own_backend
        apart = "the drafter's part and the engines' are not told apart"
        if own is None:
            return None, f"{self.spec_profile.name}'s own target-only did not load: {apart}"
        if gate is not None:
            with gate:  # the backend may be moving to its prepared passes
                pass
        try:  # after both visible runs, so it never contends with their timings
            own_reply = run_to_summary(fresh(own).stream(request, sampling, cancel))
        except Exception as e:
            return None, f"its own target-only failed ({one_line(e)}): {apart}"
        if own_reply.stop_reason == STOP_CANCELLED:
            return None, f"its own target-only was stopped: {apart}"
        return attribute(own, request, own_reply, spec, ref, sampling, self.spec_backend), ""

    def judge_floor(self, ref: Summary, left: Summary) -> Verdict:
        """The reference's two runs (the same settings, each from a fresh cache) agree, or
        NOT_REPRODUCIBLE where they part. A stopped run is compared as far as both went."""
        by_ids = bool(ref.token_ids and left.token_ids)
        n = min(len(ref.token_ids), len(left.token_ids)) if by_ids else min(len(ref.text), len(left.text))
        stopped = STOP_CANCELLED in (ref.stop_reason, left.stop_reason)
        v = judge_target_runs(self.ref_backend, [ref, left], by_ids)
        if v is not None and stopped and v.index >= n:  # parted only where a stopped reply ended
            v = None
        if v is None:
            return Verdict(IDENTICAL, compared=n, by="tokens" if by_ids else "text", complete=not stopped)
        v.why = (f"{self.ref_profile.name} gave another reply with the same settings from a fresh cache: "
                 "its own floor, no drafter in it")
        return v


def where_replies_part(ref: Summary, other: Summary) -> tuple[int, str]:
    """Where two replies shown side by side first differ (by token ids where both carry them, else by
    text), or where the shorter one ends: the place both panes are highlighted from."""
    by_ids = bool(ref.token_ids and other.token_ids)
    a, b = (ref.token_ids, other.token_ids) if by_ids else (ref.text, other.text)
    i = first_divergence(a, b)
    return (min(len(a), len(b)) if i is None else i), "tokens" if by_ids else "text"


def floor_timing(left: Summary, ref: Summary) -> Optional[str]:
    """The same run twice: how far its decode speed moved, run to run (the timing floor)."""
    if not (left.decode_tok_s and ref.decode_tok_s):
        return None
    fewest = min(left.tokens, ref.tokens) - 1
    if fewest < MIN_TIMED_TOKENS:
        return f"run to run: too short to time ({fewest} decoded tokens, {MIN_TIMED_TOKENS} needed)"
    return (f"run to run: decode tok/s {left.decode_tok_s:.1f} vs {ref.decode_tok_s:.1f} "
            f"(×{left.decode_tok_s / ref.decode_tok_s:.2f}, the timing floor)")
