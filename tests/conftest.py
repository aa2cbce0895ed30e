"""Session-wide guards for the multi-process tests.

* A forked rank runs with one intra-op thread. torch's CPU build parallelises with GNU OpenMP, which
  does not survive ``fork``: once this process has used its OpenMP pool (any op above ATen's grain
  size), a forked child's first parallel kernel waits for pool threads that were never copied and
  hangs for ever (seen: one CI run stopped at the first forked DDP test and ran out its 90 minutes).
  With one thread ATen never opens a parallel region; two ranks on two cores lose nothing by it.
* A test leaves ``MASTER_PORT`` as it found it (``_no_port_left_behind``).
* A test that still hangs ends the session after ``HANG_AFTER_S`` with every thread's traceback,
  instead of holding CI until its own limit. No test here takes a tenth of it, busy machine or not:
  it is a hang detector, not a timing assertion.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

HANG_AFTER_S = 900


def _one_thread_in_the_child() -> None:
    torch.set_num_threads(1)


os.register_at_fork(after_in_child=_one_thread_in_the_child)


@pytest.fixture
def reads_ahead(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A ``Budget``'s counts read ahead on one process too (the test switch ``_core.ahead.ON_ONE_PROCESS``: each
    adapter reads ahead as on several ranks, nothing summed); the positions of the chunks issued are listed."""
    from lightning_accum._core import ahead

    monkeypatch.setattr(ahead, "ON_ONE_PROCESS", True)
    issued: list[int] = []
    original = ahead.CountsAhead._issue

    def noting(self: ahead.CountsAhead, start: int, strategy: Any, local: Any) -> None:
        issued.append(start)
        original(self, start, strategy, local)

    monkeypatch.setattr(ahead.CountsAhead, "_issue", noting)
    return issued


@pytest.fixture(autouse=True)
def _no_port_left_behind() -> Iterator[None]:
    """A fork-launched DDP test leaves its port in this process's ``MASTER_PORT`` (Lightning's launcher sets it
    before forking), which every later test and the processes it starts would inherit: two of those started at once
    would start their ranks' stores on one port. Each test finds the environment as the session began."""
    before = os.environ.get("MASTER_PORT")
    yield
    if before is None:
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ["MASTER_PORT"] = before


@pytest.fixture(autouse=True)
def _hang_detector() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_AFTER_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
