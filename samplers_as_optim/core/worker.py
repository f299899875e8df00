"""The one worker thread per process on which noise is drawn ahead of the step.

Shared by every optimizer (``samplers._prefetch``) and by the compiled draw
(``_noise_op``): draws queue in order behind each other, and a process forked after the
thread was started gets its own.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["shared_executor"]

_executor: ThreadPoolExecutor | None = None
_executor_pid: int | None = None
_executor_lock = threading.Lock()


def shared_executor() -> ThreadPoolExecutor:
    """One worker thread per process, shared by every Optimizer (created after a fork)."""
    global _executor, _executor_pid
    with _executor_lock:
        if _executor is None or _executor_pid != os.getpid():
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler-noise")
            _executor_pid = os.getpid()
        return _executor
