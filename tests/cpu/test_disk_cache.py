"""The per-machine cache's write discipline (``dspine.cpu.disk_cache``): whole files or none, one worker at a
time, and nothing a killed process leaves behind can wedge or mislead the next one. Writers run as real
processes (``python -c``, importing only the standard library and this module) and are killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, subprocess_env

from dspine.cpu import disk_cache


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=subprocess_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_line(p: subprocess.Popen, want: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if want in line:
            return
        if not line and p.poll() is not None:
            break
    raise AssertionError(f"never printed {want!r}: {p.stderr.read()[-2000:] if p.poll() is not None else ''}")


WRITER = """
import sys
from pathlib import Path
from dspine.cpu import disk_cache
path, tag = Path(sys.argv[1]), sys.argv[2]
for i in range(int(sys.argv[3])):
    disk_cache.atomic_write(path, (tag * 200_000) + f"|{i}")
"""


def test_concurrent_writers_leave_one_complete_file(tmp_path):
    """A stress check: what a reader sees while four writers race is never torn (how much it sees depends on the
    scheduler; that a write in progress is invisible is proven step by step in the half-way test below)."""
    path = tmp_path / "cost" / "entry.json"
    writers = [_spawn(WRITER, str(path), tag, "30") for tag in "abcd"]
    while any(w.poll() is None for w in writers):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        body, _, n = text.rpartition("|")
        assert len(body) == 200_000 and len(set(body)) == 1 and n.isdigit(), "a torn or mixed file was visible"
    assert all(w.wait() == 0 for w in writers)
    body, _, n = path.read_text().rpartition("|")
    assert n == "29" and len(body) == 200_000 and body[0] in "abcd" and len(set(body)) == 1
    assert not [p for p in path.parent.iterdir() if p != path], "temporaries left behind"


HALF_WRITER = """
import os, sys, time
from pathlib import Path
from dspine.cpu import disk_cache
def half_then_hang(fd, data):
    os.write(fd, data[: len(data) // 2])
    print("HALF", flush=True)
    time.sleep(600)
disk_cache._write_all = half_then_hang
disk_cache.atomic_write(Path(sys.argv[1]), "new" * 100_000)
"""


def test_a_writer_killed_half_way_leaves_the_old_file_and_no_wedge(tmp_path):
    path = tmp_path / "entry.json"
    disk_cache.atomic_write(path, "old")
    p = _spawn(HALF_WRITER, str(path))
    _wait_for_line(p, "HALF")
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert path.read_text() == "old"
    leftovers = [x for x in tmp_path.iterdir() if x != path]
    assert len(leftovers) == 1 and disk_cache.TEMP_MARK in leftovers[0].name and str(p.pid) in leftovers[0].name
    disk_cache.atomic_write(path, "newer")  # the next writer of this host removes the dead writer's temporary
    assert path.read_text() == "newer" and sorted(tmp_path.iterdir()) == [path]


UMASK_WRITER = """
import os, sys
from pathlib import Path
os.umask(int(sys.argv[2], 8))
calls, real = [], os.umask
os.umask = lambda mask: (calls.append(mask), real(mask))[1]  # any use of os.umask from here on is recorded
from dspine.cpu import disk_cache
with disk_cache.atomic_file(Path(sys.argv[1])) as tmp:  # a writer that makes private files (safetensors: 0600)
    tmp.write_text("shared")
    tmp.chmod(0o600)
print(oct(os.stat(sys.argv[1]).st_mode & 0o777), calls, flush=True)
"""


@pytest.mark.parametrize("umask, mode", [("022", "0o644"), ("027", "0o640"), ("002", "0o664")])
def test_published_files_get_the_umask_mode_without_touching_the_umask(tmp_path, umask, mode):
    """The process umask is never set (setting it to read it races with other threads creating files): the
    published file still gets the mode a new file gets, private writers' 0600 undone."""
    p = _spawn(UMASK_WRITER, str(tmp_path / "entry.bin"), umask)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.split() == [mode, "[]"]


LOCKED_WRITER = """
import socket, sys, time
from pathlib import Path
from dspine.cpu import disk_cache
# a writer whose temporary names this host and a pid that is not alive here (another pid namespace: a container)
host = socket.gethostname().split(".")[0].replace("-", "_")
disk_cache.temp_sibling = lambda p: p.with_name(f".{p.name}{disk_cache.TEMP_MARK}{host}-{sys.argv[2]}-x")
with disk_cache.atomic_file(Path(sys.argv[1])) as tmp:
    tmp.write_text("half")
    print("WRITING", flush=True)
    time.sleep(600)
"""


def test_a_live_writer_is_told_by_its_lock_not_by_its_pid(tmp_path):
    """A temporary whose writer lives is kept though its name's pid is gone here (two containers with one host
    name and two pid namespaces); once the writer is killed its lock is free and the temporary goes."""
    path = tmp_path / "entry.json"
    ghost = next(pid for pid in range(4_000_000, 4_100_000) if not disk_cache._pid_alive(pid))
    p = _spawn(LOCKED_WRITER, str(path), str(ghost))
    try:
        _wait_for_line(p, "WRITING")
        (tmp,) = tmp_path.iterdir()
        assert str(ghost) in tmp.name and tmp.read_text() == "half"
        assert disk_cache.remove_dead_temps(path) == 0 and tmp.exists()  # alive: it holds the lock
        disk_cache.atomic_write(path, "other")  # another writer finishing meanwhile keeps it too
        assert tmp.exists() and path.read_text() == "other"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert disk_cache.remove_dead_temps(path) == 1 and sorted(tmp_path.iterdir()) == [path]


HOLDER = """
import sys, time
from pathlib import Path
from dspine.cpu import disk_cache
with disk_cache.exclusive(Path(sys.argv[1]), "building something slow") as held:
    print("HELD", flush=True)
    time.sleep(float(sys.argv[2]))
print("DONE", flush=True)
"""


def test_a_waiter_names_the_holder_and_takes_over_when_it_is_killed(tmp_path):
    lock = tmp_path / "x.lock"
    p = _spawn(HOLDER, str(lock), "600")
    _wait_for_line(p, "HELD")
    said: list[str] = []

    def kill_when_waiting(msg: str) -> None:
        said.append(msg)
        p.send_signal(signal.SIGKILL)  # the holder dies while we wait: the OS releases its lock

    with disk_cache.exclusive(lock, "the same thing", report=kill_when_waiting, poll_s=0.05) as held:
        assert held.locked and held.waited_for is not None and held.waited_for.pid == p.pid
        assert held.died is not None and held.died.pid == p.pid and held.died.what == "building something slow"
    p.wait()
    assert len(said) == 1 and f"waiting for pid {p.pid} on " in said[0] and "building something slow" in said[0]
    assert lock.read_text() == ""  # a clean turn leaves no record
    with disk_cache.exclusive(lock, "again", report=said.append) as held:
        assert held.died is None and held.waited_for is None
    assert len(said) == 1


GATED_HOLDER = """
import sys
from pathlib import Path
from dspine.cpu import disk_cache
with disk_cache.exclusive(Path(sys.argv[1]), "building something") as held:
    print("HELD", flush=True)
    sys.stdin.readline()  # holds the lock until told to finish
print("DONE", flush=True)
"""


def test_a_holder_that_finishes_hands_over_without_a_death_record(tmp_path):
    """The waiter certainly waits (the holder finishes only when the waiter's report says it is waiting), and
    the holder's clean end leaves no record of a death."""
    lock = tmp_path / "x.lock"
    p = subprocess.Popen([sys.executable, "-c", GATED_HOLDER, str(lock)], env=subprocess_env(), cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_line(p, "HELD")
    said: list[str] = []

    def release_when_waiting(msg: str) -> None:
        said.append(msg)
        p.stdin.write("go\n")
        p.stdin.flush()

    with disk_cache.exclusive(lock, "after it", report=release_when_waiting, poll_s=0.05) as held:
        assert held.waited_for is not None and held.waited_for.pid == p.pid and held.died is None
    assert p.wait(timeout=120) == 0
    assert len(said) == 1 and f"waiting for pid {p.pid}" in said[0]


def test_an_exception_inside_is_not_a_death(tmp_path):
    lock = tmp_path / "x.lock"
    with pytest.raises(RuntimeError), disk_cache.exclusive(lock, "failing"):
        raise RuntimeError("compile error")
    with disk_cache.exclusive(lock, "next") as held:
        assert held.died is None


def test_publish_dir_replaces_a_damaged_entry(tmp_path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "half").write_text("damaged")
    tmp = disk_cache.temp_sibling(final)
    tmp.mkdir()
    (tmp / "whole").write_text("ok")
    disk_cache.publish_dir(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["whole"] and sorted(tmp_path.iterdir()) == [final]


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "c"))
    assert disk_cache.cache_root() == tmp_path / "c"
    monkeypatch.delenv("DSPINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_root() == tmp_path / "xdg" / "dspine"
    assert os.path.basename(disk_cache.temp_sibling(tmp_path / "f.json")).startswith(".f.json" + disk_cache.TEMP_MARK)
