"""The daemon's files: the journal (append-only, rotated, torn lines skipped) and progress.json."""

from __future__ import annotations

from pathlib import Path

from timeshare.daemon.records import (
    JOURNAL_FILE,
    Journal,
    journal_entry,
    read_journal,
    read_progress,
    write_progress,
)


def test_the_journal_rotates_and_reads_back_in_order(tmp_path: Path) -> None:
    journal = Journal(tmp_path, max_bytes=2000)
    for n in range(100):
        journal.append([journal_entry("transition", n=n)])
    journal.sync()
    journal.close()
    assert (tmp_path / f"{JOURNAL_FILE}.1").exists()
    assert (tmp_path / JOURNAL_FILE).stat().st_size <= 2000
    numbers = [e["n"] for e in read_journal(tmp_path)]
    assert numbers == list(range(numbers[0], 100))  # oldest dropped, the rest whole and in order
    assert len(numbers) >= 2000 // 80


def test_a_line_torn_by_a_crash_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append([journal_entry("a"), journal_entry("b")])
    journal.close()
    with open(tmp_path / JOURNAL_FILE, "ab") as file:
        file.write(b'{"time": 1, "kind": "tor')
    assert [e["kind"] for e in read_journal(tmp_path)] == ["a", "b"]


def test_progress_is_replaced_whole(tmp_path: Path) -> None:
    assert read_progress(tmp_path) == {}
    write_progress(tmp_path, {"committed_step": 3})
    write_progress(tmp_path, {"committed_step": 4})
    assert read_progress(tmp_path) == {"committed_step": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress.json"]  # no temporary left
    (tmp_path / "progress.json").write_text("{not json")
    assert read_progress(tmp_path) == {}
