"""A wall-clock guard for tests of inputs that must not hang (SIGALRM; main thread, POSIX)."""

import signal
from contextlib import contextmanager


@contextmanager
def time_limit(seconds: int):
    def handler(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
