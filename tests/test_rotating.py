"""A log file that several real processes append to, rotated at a size: no line lost, torn or
split across files, and no more generations kept than asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from timeshare.rotating import RotatingFile, rotated_paths

WRITER = """
import sys
from pathlib import Path
from timeshare.rotating import RotatingFile
path, name, count, max_bytes, keep = sys.argv[1:]
log = RotatingFile(Path(path), int(max_bytes), int(keep))
for index in range(int(count)):
    log.write(f"{name} {index:05d} " + "x" * 60 + "\\n")
log.close()
"""


def write_from_processes(path: Path, writers: int, lines: int, max_bytes: int, keep: int) -> None:
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                str(path),
                f"w{n}",
                str(lines),
                str(max_bytes),
                str(keep),
            ]
        )
        for n in range(writers)
    ]
    for process in processes:
        assert process.wait(timeout=60) == 0


def test_every_line_of_every_writer_is_kept_whole_across_rotations(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_from_processes(path, writers=4, lines=500, max_bytes=8192, keep=10_000)
    files = rotated_paths(path)
    assert len(files) > 10
    lines = [line for file in files for line in file.read_text().splitlines()]
    assert sorted(lines) == sorted(
        f"w{n} {index:05d} " + "x" * 60 for n in range(4) for index in range(500)
    )
    for n in range(4):  # each writer's lines in the order it wrote them, across the files
        own = [line for line in lines if line.startswith(f"w{n} ")]
        assert own == sorted(own)
    assert all(file.stat().st_size < 8192 + 4 * 80 for file in files)


def test_only_keep_generations_stay(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_from_processes(path, writers=2, lines=400, max_bytes=4096, keep=2)
    assert [p.name for p in rotated_paths(path)] == ["log.jsonl.2", "log.jsonl.1", "log.jsonl"]


def test_without_a_size_nothing_rotates(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RotatingFile(path, 0, 3)
    for index in range(1000):
        log.write(f"{index}\n")
    log.close()
    assert rotated_paths(path) == [path]
    assert len(path.read_text().splitlines()) == 1000
