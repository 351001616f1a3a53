"""A thread that issues CUDA copies off the engine's step.

Why: issuing copies costs host time (descriptor arithmetic, the runtime's per-copy work:
about 0.5 us per copy inside ``cudaMemcpyBatchAsync``, so ~1 ms for a 64-block job in
the per-layer layout). Paid on the engine's thread, it delays the forward's kernel
launches by exactly that much: the step gets slower although the copy engines never
touch the SMs. Handed to this thread, the engine pays only for recording one CUDA event
(which fixes the copies' place in stream order) and a queue put.

The copies still start promptly: ctypes releases the GIL inside the runtime call, and the
engine's thread releases it while it waits for the device.

Start delay. Woken from idle, the thread first sleeps :attr:`IssueThread.delay` seconds:
the engine submits its step's jobs back to back and then launches the forward, and a
thread that takes the GIL at once makes every one of those calls wait for it (each
hand-off of the GIL between threads costs tens of microseconds on the H100 machines).
A caller that blocks on a job meanwhile issues it itself (the mover's ``wait``), so the
delay never adds latency to a transfer that someone waits for.

Stale work. Work submitted with a ``stale`` check (the mover's: "a waiting caller has
claimed this job") is dropped when the thread wakes, before the delay: otherwise the thread
takes the GIL twice more (after waking, after sleeping) while that caller is issuing the
job, each time at one of the caller's CUDA calls that release it, and each hand-off costs
the caller tens of microseconds before its first DMA.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch

__all__ = ["IssueThread"]

_Work = tuple[Callable[[], None], Callable[[], bool] | None]


class IssueThread:
    """One daemon thread that runs submitted callables in submission order.

    Args:
        device: the CUDA device whose context the thread uses (the CUDA runtime's
            current device is per thread).
        name: the thread's name, for debuggers and ``threading.enumerate()``.

    The callables must not raise: each one reports its own failure (the mover marks the
    job failed). :meth:`close` stops the thread after the work already queued.
    """

    def __init__(self, device: torch.device, name: str, delay: float = 0.0) -> None:
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self.delay = delay
        self._thread = threading.Thread(target=self._run, args=(device, self._queue, self),
                                        name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @staticmethod
    def _run(device: torch.device, work: queue.SimpleQueue[_Work | None],
             owner: IssueThread) -> None:
        # A static method holding only the queue and this object: the thread keeps no
        # reference to the mover, so a mover dropped without shutdown() can be collected.
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            try:
                item = work.get_nowait()  # more work queued: no delay
            except queue.Empty:
                item = work.get()
                if item is not None and item[1] is not None and item[1]():
                    continue  # done by someone else meanwhile: no delay, no call
                if item is not None and owner.delay > 0:
                    time.sleep(owner.delay)  # woken from idle: let the submitter run on
            if item is None:
                return
            fn, stale = item
            if stale is None or not stale():
                fn()

    def submit(self, fn: Callable[[], None], stale: Callable[[], bool] | None = None) -> None:
        """Run ``fn`` on the thread after everything submitted before it.

        Args:
            stale: if given and true when the thread reaches the work, ``fn`` is skipped
                (someone else did it); checked without waiting for the start delay.
        """
        self._queue.put((fn, stale))

    def close(self, *, join: bool = True, timeout: float | None = None) -> None:
        """Stop the thread once the queued work is done (and wait for it when ``join``)."""
        self._queue.put(None)
        if join and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


# Threads still alive at interpreter exit are stopped and joined first: a daemon thread
# that finalization catches inside torch's C++ is unwound by pthread_exit and aborts the
# process ("terminate called without an active exception", seen on an H100 at the end
# of the test suite).
_LIVE: weakref.WeakSet[IssueThread] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for issuer in list(_LIVE):
        issuer.close(timeout=10.0)
