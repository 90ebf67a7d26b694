"""One run per directory: a held lock refuses a second run naming the holder; a lock
left by a dead process is taken over with a warning naming it. (A real second
``recpipe train`` on a running run's directories: tests/test_preemption.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from recpipe.config import load_config
from recpipe.errors import DirInUseError
from recpipe.exit_codes import EXIT_DIR_IN_USE
from recpipe.run_lock import LOCK_FILE, DirLock, hold_run_dirs


def test_a_held_directory_is_refused_naming_the_holder(tmp_path):
    holder = DirLock(tmp_path, "checkpoint.dir").acquire()
    try:
        with pytest.raises(DirInUseError, match=f"checkpoint.dir=.* is in use by another recpipe run: pid {os.getpid()} "
                           f"on host {socket.gethostname()}") as err:
            DirLock(tmp_path, "checkpoint.dir").acquire()
        assert err.value.exit_code == EXIT_DIR_IN_USE
    finally:
        holder.release()
    DirLock(tmp_path, "checkpoint.dir").acquire().release()  # free again
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release leaves nothing to take over


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": "gpu-node-7", "started": "yesterday"}))
    with pytest.warns(UserWarning, match=f"taking over the lock left by pid {pid} on host gpu-node-7"):
        lock = DirLock(tmp_path, "logging.run_dir").acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_one_directory_for_both_keys_is_locked_once(tmp_path):
    cfg = load_config(None, [f"logging.run_dir={tmp_path}", f"checkpoint.dir={tmp_path}/."])
    with hold_run_dirs(cfg.logging.run_dir, cfg.checkpoint.dir):
        with pytest.raises(DirInUseError, match="logging.run_dir"):
            with hold_run_dirs(cfg.logging.run_dir, cfg.checkpoint.dir):
                pass
