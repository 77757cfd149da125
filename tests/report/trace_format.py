"""A strict check of Chrome's trace-event format (the "Trace Event Format" document), for the
events timeshare writes, and of what a timeline needs: slices that nest and never overlap on a
track, and timestamps that never go back on one.

Perfetto's own trace processor downloads a binary when it starts, which the test machine
cannot; this checks every field the format requires instead, and refuses what it does not
define.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Every key the format defines for an event; anything else is refused.
KEYS = {"name", "cat", "ph", "ts", "tts", "pid", "tid", "dur", "tdur", "args", "s", "id", "cname"}
METADATA = {
    "process_name": ("name", str),
    "process_labels": ("labels", str),
    "process_sort_index": ("sort_index", int),
    "thread_name": ("name", str),
    "thread_sort_index": ("sort_index", int),
}
Event = dict[str, Any]


def load_trace(path: Path) -> list[Event]:
    """The events of a whole trace file (its closing bracket included: strict JSON)."""
    events = json.loads(path.read_text())
    assert isinstance(events, list), "a trace in the JSON array format"
    return events


def check_events(events: Sequence[Mapping[str, Any]]) -> None:
    """Raise AssertionError naming the first event that breaks the format."""
    for index, event in enumerate(events):
        where = f"event {index} {event!r}"
        assert isinstance(event, dict), where
        assert set(event) <= KEYS, f"{where}: keys the format does not define"
        assert isinstance(event.get("name"), str) and event["name"], f"{where}: name"
        assert _is_int(event.get("pid")) and _is_int(event.get("tid")), f"{where}: pid, tid"
        if "cat" in event:
            assert isinstance(event["cat"], str), f"{where}: cat"
        if "args" in event:
            assert isinstance(event["args"], dict), f"{where}: args"
            json.dumps(event["args"], allow_nan=False)  # plain JSON values only
        phase = event.get("ph")
        if phase == "X":
            assert _is_time(event.get("ts")) and _is_time(event.get("dur")), f"{where}: ts, dur"
            assert event["dur"] >= 0, f"{where}: negative dur"
        elif phase in ("i", "I"):
            assert _is_time(event.get("ts")), f"{where}: ts"
            assert event.get("s", "t") in ("g", "p", "t"), f"{where}: scope"
            assert "dur" not in event, f"{where}: an instant has no dur"
        elif phase == "M":
            assert event["name"] in METADATA, f"{where}: unknown metadata"
            key, kind = METADATA[event["name"]]
            assert isinstance(event.get("args", {}).get(key), kind), f"{where}: args.{key}"
        else:
            raise AssertionError(f"{where}: phase {phase!r} is not one timeshare writes")


def check_timeline(events: Sequence[Mapping[str, Any]]) -> None:
    """On each track (pid, tid): timestamps never go back, in the file's order, and complete
    slices nest (one inside another, or one after the other, never half over)."""
    by_track: dict[tuple[int, int], list[Mapping[str, Any]]] = defaultdict(list)
    for event in events:
        if event["ph"] != "M":
            by_track[(event["pid"], event["tid"])].append(event)
    for track, timeline in by_track.items():
        stamps = [ns(e["ts"]) for e in timeline]
        assert stamps == sorted(stamps), f"track {track}: timestamps go back"
        open_slices: list[tuple[int, int, str]] = []  # (start, end, name), outermost first
        for event in timeline:
            if event["ph"] != "X":
                continue
            start, end = ns(event["ts"]), ns(event["ts"]) + ns(event["dur"])
            while open_slices and open_slices[-1][1] <= start:
                open_slices.pop()  # ended before this one starts
            if open_slices:
                outer = open_slices[-1]
                assert end <= outer[1], (
                    f"track {track}: {event['name']} [{start}, {end}] overlaps "
                    f"{outer[2]} [{outer[0]}, {outer[1]}] without nesting in it"
                )
            open_slices.append((start, end, event["name"]))


def ns(microseconds: float) -> int:
    """A trace time (µs, to the ns) as integer nanoseconds."""
    return round(microseconds * 1000)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
