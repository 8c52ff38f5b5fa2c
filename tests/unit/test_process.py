"""celery_zk.zk.process: the pid that fork checks compare against."""
from __future__ import annotations

import os

from celery_zk.zk.process import current_pid


def test_the_pid_is_this_processs() -> None:
    assert current_pid() == os.getpid()


def test_a_forked_child_is_told_its_own_pid_not_its_parents() -> None:
    # Every "was I forked?" check (sessions, registrations, threads) compares
    # with this: a child told its parent's pid would use the parent's session.
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write_end, f"{current_pid()} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    told, real = os.read(read_end, 64).split()
    os.close(read_end)
    os.waitpid(child, 0)
    assert int(real) == child
    assert int(told) == child
    assert current_pid() == os.getpid() != child
