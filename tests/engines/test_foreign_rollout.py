"""What vLLM's and SGLang's rollout engines share (engines/foreign.py `ForeignRollout`), against
an engine of real processes that are no inference engine: two `sleep`s titled as an engine titles
its TP workers, one of them mapping a shared memory segment. The real engines' own tests run the
same paths on vLLM and SGLang (tests/engines/vllm, tests/engines/sglang)."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from timeshare.engines.base import RolloutRequest, RolloutSample, RolloutTraits
from timeshare.engines.foreign import ForeignRollout, compile_caches
from timeshare.engines.inlet import WeightInlet
from timeshare.errors import EngineBroken, TimeshareError
from timeshare.protocols.weights import TransferConfig
from timeshare.runtime import (
    FOREIGN_SEGMENTS_SUFFIX,
    FOREIGN_TEMP_MAKER,
    FOREIGN_TEMP_PREFIX,
    foreign_temp_dir,
    record_foreign_segments,
    running_since,
    sweep_foreign_segments,
    sweep_foreign_temp_dirs,
)

SEGMENT = f"tsfake_{os.getpid()}"
MAPS_THE_SEGMENT = f"""
import mmap, time
with open("/dev/shm/{SEGMENT}", "r+b") as f:
    m = mmap.mmap(f.fileno(), 4096)
time.sleep(60)
"""


class FakeEngine(ForeignRollout):
    """Two processes titled `FAKE::Worker_TP0` and `FAKE::Worker_TP1`; shutting down ends them."""

    name = "Fake"
    title_prefix = "FAKE::"
    segment_prefixes = ("tsfake_",)

    def __init__(self, runtime_dir: Path, *, releases: bool = True) -> None:
        super().__init__(0, runtime_dir, 5.0, 30.0, releases=releases)
        (self.scratch() / "config.json").write_text("{}")
        # argv[0] is the title a process shows in /proc/<pid>/cmdline; started as a real
        # engine starts its processes: they are what `starting` sees this process start
        with self.starting("TS_FAKE_HOST_PID", {}):
            self.processes = [
                subprocess.Popen(
                    [f"FAKE::Worker_TP{tp}", "-c", MAPS_THE_SEGMENT], executable=sys.executable
                )
                for tp in range(2)
            ]
        self.record_processes()

    def shutdown_engine(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()

    def _mb(self) -> float:
        return 10.0

    # (what an engine does with a model: not this class's concern)
    def sleep(self) -> None:
        raise NotImplementedError

    def wake(self, tags: set[str]) -> None:
        raise NotImplementedError

    def traits(self) -> RolloutTraits:
        raise NotImplementedError

    def generate(self, requests: list[RolloutRequest]) -> list[RolloutSample]:
        raise NotImplementedError

    def open_inlet(self, endpoint: str, transfer: TransferConfig) -> WeightInlet:
        raise NotImplementedError


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[FakeEngine]:
    segment = Path(f"/dev/shm/{SEGMENT}")
    segment.write_bytes(bytes(4096))
    try:  # (a start that fails leaves neither the segment nor the processes)
        engine = FakeEngine(tmp_path / "runtime")
        try:
            deadline = time.monotonic() + 30
            while len(engine._titles) < 2 or not record_of(engine).exists():  # exec'd, mapped
                assert time.monotonic() < deadline, "the fake engine's processes did not start"
                time.sleep(0.05)
                engine.record_processes()
            yield engine
        finally:
            engine.close()
    finally:
        segment.unlink(missing_ok=True)


def record_of(engine: FakeEngine) -> Path:
    return engine.runtime_dir / f"{engine.owner}{FOREIGN_SEGMENTS_SUFFIX}"


def test_its_processes_and_their_segments_are_recorded_and_close_releases_everything(
    engine: FakeEngine,
) -> None:
    deadline = time.monotonic() + 30
    while SEGMENT not in record_of(engine).read_text():  # python3 mapped it
        assert time.monotonic() < deadline, "the segment was never recorded"
        time.sleep(0.05)
        engine.record_processes()
    assert sorted(engine._titles.values()) == ["FAKE::Worker_TP0", "FAKE::Worker_TP1"]
    assert sorted(engine._children) == sorted(p.pid for p in engine.processes)
    scratch = engine.scratch()
    # in a directory naming this process: a sweep removes it should this process be killed
    maker = json.loads((scratch.parent / FOREIGN_TEMP_MAKER).read_text())
    assert scratch.parent.name.startswith(FOREIGN_TEMP_PREFIX) and maker["pid"] == os.getpid()
    engine.close()
    assert all(running_since(p.pid) is None for p in engine.processes)  # reaped: no zombie
    assert not record_of(engine).exists()
    assert not Path(f"/dev/shm/{SEGMENT}").exists()
    assert not scratch.parent.exists()


def test_its_processes_are_what_its_start_started_not_its_hosts_other_children(
    tmp_path: Path,
) -> None:
    """A process may host two engines (the contract tests do), or children of its own: an
    engine records, names and ends only what its own start made the host start."""
    # another engine's, under the same title prefix (argv[0] a title: sys.executable runs)
    title = "FAKE::Worker_TP9"
    other = subprocess.Popen(
        [title, "-c", "import time; time.sleep(60)"], executable=sys.executable
    )
    Path(f"/dev/shm/{SEGMENT}").write_bytes(bytes(4096))
    engine = FakeEngine(tmp_path / "runtime")
    try:
        assert sorted(engine.own_processes()) == sorted(p.pid for p in engine.processes)
        assert other.pid not in engine._titles and other.pid not in engine._children
        owners = json.loads(record_of(engine).read_text())["owners"]
        assert other.pid not in [pid for pid, _ in owners]
        engine.close()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(timeout=30)
        Path(f"/dev/shm/{SEGMENT}").unlink(missing_ok=True)


def test_a_call_that_fails_because_a_worker_died_names_that_worker(engine: FakeEngine) -> None:
    victim = engine.processes[1]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)

    def dead_engine() -> None:
        raise RuntimeError("engine core is dead")

    with pytest.raises(EngineBroken) as failed:
        engine.call("update_weights", dead_engine)
    said = str(failed.value)
    worker = f"TP worker 1 (FAKE::Worker_TP1, pid {victim.pid})"
    assert f"Fake rollout rank 0: update_weights failed, {worker} exited" in said
    assert "RuntimeError: engine core is dead" in said
    with pytest.raises(EngineBroken, match="Fake rollout rank 0 is unusable: TP worker 1"):
        engine.call("generate", lambda: None)


def test_a_call_that_fails_with_every_process_alive_is_its_own_error(engine: FakeEngine) -> None:
    def refuses() -> None:
        raise ValueError("bad argument")

    with pytest.raises(ValueError, match="bad argument"):
        engine.call("update_weights", refuses)
    assert engine.call("ping", lambda: "pong") == "pong"  # still usable


def test_a_call_past_its_deadline_breaks_the_engine_for_good(engine: FakeEngine) -> None:
    with pytest.raises(EngineBroken, match=r"fake-wake_up did not return within 0\.2 s"):
        engine.call("wake_up", lambda: time.sleep(5), timeout_s=0.2)
    with pytest.raises(EngineBroken, match="is unusable"):
        engine.call("ping", lambda: "pong")


def test_memory_held_is_what_sleep_can_release_and_resident_what_it_cannot(
    tmp_path: Path,
) -> None:
    releasing = FakeEngine.__new__(FakeEngine)
    ForeignRollout.__init__(releasing, 0, tmp_path, 5.0, 30.0, releases=True)
    assert (releasing.held_mb(), releasing.resident_mb()) == (10.0, 0.0)
    releasing.asleep = {"weights"}
    assert releasing.held_mb() == 10.0  # the KV cache is still held
    releasing.asleep = {"weights", "kv_cache"}
    assert releasing.held_mb() == 0.0

    pausing = FakeEngine.__new__(FakeEngine)
    ForeignRollout.__init__(pausing, 0, tmp_path, 5.0, 30.0, releases=False)
    assert (pausing.held_mb(), pausing.resident_mb()) == (0.0, 10.0)
    with pytest.raises(TimeshareError, match="no whole weight version"):
        pausing.digest()


def test_an_engine_broken_inside_a_call_is_raised_as_it_was_said(engine: FakeEngine) -> None:
    """(SGLang's SIGQUIT handler raises EngineBroken, naming the process, inside a call.)"""
    engine.processes[0].send_signal(signal.SIGKILL)
    engine.processes[0].wait(timeout=30)

    def broken() -> None:
        raise EngineBroken("Fake rollout rank 0: one of its processes failed")

    with pytest.raises(EngineBroken) as failed:
        engine.call("flush_cache", broken)
    assert str(failed.value) == "Fake rollout rank 0: one of its processes failed"


LEAVES_A_SOCKET = """
import socket, tempfile
listener = socket.socket(socket.AF_UNIX)
listener.bind(tempfile.mktemp(suffix=".sock"))  # as libzmq does: the file stays at exit
"""


def test_what_its_processes_leave_in_tmpdir_goes_with_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM and SGLang make their ipc sockets in TMPDIR, where libzmq leaves the files: started
    under `starting`, an engine's processes make them in a directory of its own, recorded in
    the runtime dir, which its close removes, or a sweep once its processes are gone (a
    SIGKILLed worker). (pytest's tmp_path is long: a socket's path in the runtime dir would not
    fit in 107 bytes.)"""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    outside = tempfile.gettempdir()
    for ending in ("close", "sweep"):
        runtime = tmp_path / ending
        engine = FakeEngine.__new__(FakeEngine)
        ForeignRollout.__init__(engine, 0, runtime, 5.0, 30.0, releases=True)
        engine.processes = []  # (its processes: the one started below)
        with engine.starting("TS_FAKE_HOST_PID", {}):
            assert engine.temp is not None
            temp = engine.temp
            assert tempfile.gettempdir() == str(temp)
            subprocess.run([sys.executable, "-c", LEAVES_A_SOCKET], check=True, timeout=60)
            # torch's compiler cache stays where it is without the engine's TMPDIR: kept
            # from one start to the next, not compiled again into a directory that goes
            said = python_says("import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
            assert said == f"{outside}/torchinductor_{getpass.getuser()}"
        assert tempfile.gettempdir() != str(temp)
        assert sorted(p.suffix for p in temp.iterdir()) == [".json", ".sock"]  # (its maker)
        if ending == "close":
            engine.close()
        else:  # its record names this process; a process that has exited stands in for it
            gone = int(python_says("import os; print(os.getpid())"))
            record_foreign_segments(runtime, engine.owner, [gone], [], temp)
            assert str(temp) in sweep_foreign_segments(runtime)
        assert not temp.exists()
        assert list(runtime.iterdir()) == []


MAKES_A_TEMP_DIR = """
from timeshare.runtime import foreign_temp_dir
print(foreign_temp_dir("vllm-rank0"))
"""


def test_its_temporary_directory_goes_once_its_maker_is_gone_record_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime dir deleted after a SIGKILL takes the engine's record with it: the directory
    says itself which process made it (pid, start time, pid namespace)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = foreign_temp_dir("sglang-rank0")  # this process's: alive
    made = subprocess.run(
        [sys.executable, "-c", MAKES_A_TEMP_DIR],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    gone = Path(made.stdout.strip())
    assert gone.parent == tmp_path
    (gone / "left.sock").touch()  # what libzmq leaves
    unnamed = tmp_path / "timeshare-tmp-made-by-hand"  # names no maker: not ours to judge
    unnamed.mkdir()
    elsewhere = tmp_path / "timeshare-tmp-of-another-container"
    shutil.copytree(gone, elsewhere)  # its maker's pid means nothing in this pid namespace
    maker = json.loads((elsewhere / FOREIGN_TEMP_MAKER).read_text())
    maker["pid_namespace"] += 1
    (elsewhere / FOREIGN_TEMP_MAKER).write_text(json.dumps(maker))
    assert sweep_foreign_temp_dirs(tmp_path) == [str(gone)]
    assert live.is_dir() and unnamed.is_dir() and elsewhere.is_dir() and not gone.exists()


def test_the_compiler_settings_the_user_made_stay_as_they_made_them() -> None:
    default = f"{tempfile.gettempdir()}/torchinductor_{getpass.getuser()}"
    assert compile_caches({}) == {
        "TORCHINDUCTOR_CACHE_DIR": default,
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
    }
    users = {
        "TORCHINDUCTOR_CACHE_DIR": "/srv/cache",
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1",
    }
    assert compile_caches(users) == {}


def python_says(code: str) -> str:
    """What a Python child running `code` prints (stripped)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()
