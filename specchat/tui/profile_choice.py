"""Choosing a profile in the TUI: the picker's lines (F2) and the command palette's "Profile: NAME",
both from `specchat.availability`, so each refuses what cannot run now with the same reason."""
from __future__ import annotations

import asyncio
from functools import partial
from typing import Optional

from textual.command import DiscoveryHit, Hit, Hits, Provider

from specchat import availability
from specchat.availability import Availability
from specchat.profiles import Profile, ProfileSet
from specchat.tui.widgets import PickerRow


def profile_line(p: Profile) -> str:
    method = p.method_label if p.remote else "target-only" if p.method == "none" else f"{p.method} (depth {p.speculative.depth})"
    return f"{method} · {p.backend} · {p.model}"


def picker_rows(found: list[Availability]) -> list[PickerRow]:
    """The profile picker's lines: a heading per group (here first), each profile with why it does
    not run here; one that cannot run now is refused (a download is not: loading fetches it)."""
    rows, group = [], None
    for a in found:
        if a.group != group:
            group = a.group
            rows.append(PickerRow(None, a.heading, style=a.colour))
        line = profile_line(a.profile) if a.profile else "broken"
        rows.append(PickerRow(a.name, line, a.reason, "dim" if a.group == "server" else a.colour,
                              refused=not a.choosable, note=a.reason if a.group == "download" else ""))
    return rows


class ProfileCommands(Provider):
    """Command palette: "Profile: NAME" switches to it once it is checked as the picker checks it
    (one that cannot run now says why instead of loading)."""

    found: Optional[list[Availability]] = None

    async def startup(self) -> None:  # weight headers are read: off the UI thread
        self.found = await asyncio.to_thread(self._classify)

    def _classify(self) -> list[Availability]:
        return availability.classify(self.app.profile_set(), probe_servers=False, unprobed="")

    def _items(self):
        for a in sorted(self.found if self.found is not None else self._classify(), key=lambda a: a.name):
            line = profile_line(a.profile) if a.profile else ""
            mark = " (broken)" if a.group == "broken" else f" ({a.heading})" if a.group in ("gpu", "download") else ""
            yield f"Profile: {a.name}{mark}", " · ".join(filter(None, [line, a.reason])), a.name

    async def discover(self) -> Hits:
        for title, help_, name in self._items():
            yield DiscoveryHit(title, partial(self.app.choose_profile, name), help=help_)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_, name in self._items():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self.app.choose_profile, name), help=help_)


def availability_of(ps: ProfileSet, name: str) -> Availability:
    """One profile's availability, its server asked (a short timeout: call it off the UI thread)."""
    one = ProfileSet({name: ps.profiles[name]} if name in ps.profiles else {},
                     {name: ps.errors[name]} if name in ps.errors else {})
    found = availability.classify(one)
    return found[0] if found else Availability(name, "broken", f"no profile named '{name}'")
