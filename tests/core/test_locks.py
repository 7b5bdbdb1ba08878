import os
import sys
import threading
import time

import pytest

from qjl.core.locks import cache_lock

posix = pytest.mark.skipif(sys.platform == "win32", reason="the lock needs fcntl")


@posix
def test_second_holder_waits_until_the_first_leaves(tmp_path):
    """flock locks belong to an open file, so two threads of one process exclude each other as two processes do."""
    events, inside = [], threading.Event()

    def first():
        with cache_lock(tmp_path / "x"):
            events.append("first in")
            inside.set()
            time.sleep(0.3)
            events.append("first out")

    t = threading.Thread(target=first)
    t.start()
    inside.wait(10)
    with cache_lock(tmp_path / "x"):
        events.append("second in")
    t.join()
    assert events == ["first in", "first out", "second in"]
    assert (tmp_path / "x.lock").exists()


@posix
def test_different_paths_do_not_wait(tmp_path):
    done = []

    def other():
        with cache_lock(tmp_path / "b"):
            done.append(True)

    with cache_lock(tmp_path / "a"):
        t = threading.Thread(target=other)
        t.start()
        t.join(5)
        assert done == [True]


def test_unwritable_folder_runs_the_block_unlocked(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode: make the lock's folder a file instead
            ro.chmod(0o700)
            ro.rmdir()
            ro.write_text("")
        ran = []
        with cache_lock(ro / "sub" / "x"):
            ran.append(1)
        assert ran == [1]
    finally:
        ro.chmod(0o700)
