"""Preemption: SIGTERM (what SLURM and torchrun send), SIGINT (Ctrl-C), SIGHUP (a closed terminal)
and SIGUSR1 (SLURM's `--signal` warning) stop a run the way a user of a cluster expects: with a
checkpoint to resume from and one line that says where.

Inside a training loop (`deferred`) a signal only sets a flag: the loop finishes its step, asks
`requested()` (agreed over ranks, so that every rank saves at the same step), saves a checkpoint,
prints where, and raises Preempted. Elsewhere a signal raises Preempted at once, after one line: the
stages before PPO write what they finish whole (cached stages, value pretraining's checkpoints) and
a rerun reuses it. Either way the process exits with 128 + the signal's number (train.py).

torchrun forwards the signal it receives to every rank, which SLURM has often signalled already: a
repeat within REPEAT_S is the same request. A later one ends the process at once, without saving.
(torchrun forwards SIGUSR1 only when `--signals-to-handle` lists it; otherwise it dies of it.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from tqdm import tqdm

import fsdp_utils
from reward import STOP_SIGNALS as SIGNALS  # the ones the grader workers ignore
REPEAT_S = 5.0


class Preempted(BaseException):
    """The run stopped on a signal (a BaseException: no `except Exception` on the way up may take it
    for an error of its own). The line saying what was kept is already printed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.exit_code = signum, 128 + signum


_received: tuple[int, float] | None = None  # (signal, when) of the first signal
_deferring, _on_stop = False, lambda: ""


def _handle(signum, frame) -> None:
    global _received
    name = signal.Signals(signum).name
    if _received is not None:
        if time.monotonic() - _received[1] < REPEAT_S:
            return  # the same request, forwarded
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # a second request: stop now
        return
    _received = (signum, time.monotonic())
    if _deferring:
        if fsdp_utils.is_main():
            tqdm.write(f"{name}: stopping after this step, with a checkpoint (send it again after "
                       f"{REPEAT_S:.0f} s to stop at once, without one)")
        return
    if fsdp_utils.is_main():
        tqdm.write(f"{name}: stopped. {_on_stop()}")
    raise Preempted(signum)


@contextlib.contextmanager
def handled(on_stop):
    """SIGNALS handled as the module says for the block (in the main thread); `on_stop()`: what a
    signal outside a training loop leaves, e.g. where to resume from, in a sentence."""
    global _received, _on_stop
    _received, _on_stop = None, on_stop
    previous = {s: signal.signal(s, _handle) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _received = None


@contextlib.contextmanager
def deferred():
    """Inside, a signal waits for the loop to ask `requested()`."""
    global _deferring
    _deferring = True
    try:
        yield
    finally:
        _deferring = False


def requested() -> bool:
    """Whether a rank received a signal: every rank then saves at this step and calls `stop`."""
    return fsdp_utils.any_rank(_received is not None)


def stop(saved: str) -> Preempted:
    """After `requested()` and the save: the line that says where to resume from, and the exception to raise."""
    if fsdp_utils.is_main():
        tqdm.write(f"{saved}; resume with the same command and --resume")
    return Preempted(_received[0] if _received else signal.SIGTERM)
