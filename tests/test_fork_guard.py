"""The session's fork guard (``tests/conftest.py``): a rank forked after this process used its OpenMP pool
runs one intra-op thread, so its first parallel kernel cannot wait for pool threads fork never copied."""

from __future__ import annotations

import os

import torch


def test_a_child_forked_after_the_pool_ran_has_one_thread() -> None:
    x = torch.randn(1_000_000)
    (x * 2).sum()  # above ATen's grain size: the pool runs (with more than one thread on this machine)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (reads the count only: no parallel region, so this child cannot hang either way)
        os.write(write, str(torch.get_num_threads()).encode())
        os._exit(0)
    os.close(write)
    got = os.read(read, 16)
    os.waitpid(pid, 0)
    assert got == b"1"
