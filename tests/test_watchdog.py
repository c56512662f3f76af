"""commlib.mpi.watchdog.Watchdog: deadlines expire, and nothing a call armed stays referenced
by the watchdog's thread once the call disarmed (an entry's ``what`` holds the call's
buffers, so the user's tensor)."""
import gc
import threading
import time
import weakref

from commlib.mpi.watchdog import Watchdog


class Payload:
    """Stands for a call's buffer."""


def _ticks(dog: Watchdog, n: int) -> None:
    time.sleep(dog._poll_s * (n + 0.5))


def test_disarmed_entries_are_not_kept_alive():
    dog = Watchdog(on_expiry=lambda what: None, poll_s=0.01)
    try:
        payload = Payload()
        gone = weakref.ref(payload)
        tid = threading.get_ident()
        dog.armed[tid] = (time.monotonic() + 3600, ("allreduce", 0, payload, None))
        _ticks(dog, 5)                     # the thread looks at the entry several times
        dog.armed.pop(tid)
        del payload
        _ticks(dog, 5)                     # and then at an empty table
        gc.collect()
        assert gone() is None, "the watchdog thread keeps a disarmed call's buffer alive"
    finally:
        dog.stop()


def test_a_passed_deadline_expires_once():
    seen = []
    dog = Watchdog(on_expiry=seen.append, poll_s=0.01)
    try:
        dog.armed[1] = (time.monotonic() - 1, "late call")
        _ticks(dog, 5)
        assert seen == ["late call"]
    finally:
        dog.stop()
