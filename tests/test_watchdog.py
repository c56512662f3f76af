"""commlib.mpi.watchdog.Watchdog: deadlines expire, and nothing a call armed stays referenced
by the watchdog's thread once the call disarmed (an entry's ``what`` holds the call's
buffers, so the user's tensor)."""
import gc
import threading
import time
import weakref

from commlib.mpi.watchdog import Watchdog, postpone


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


def test_postpone_moves_only_the_calling_threads_deadline_and_never_earlier():
    """A step that bounds itself (a fault-tolerant creation's attempt) inside an armed call
    moves that call's deadline out; a thread with no deadline gets none, another thread's
    stays, and a deadline already later is kept. Negative control: without the postpone
    the same deadline expires."""
    seen = []
    dog = Watchdog(on_expiry=seen.append, poll_s=0.01)
    try:
        me = threading.get_ident()
        other = me + 1
        dog.armed[me] = (time.monotonic() + 0.05, "mine")
        dog.armed[other] = (time.monotonic() + 1000, "other's")
        postpone(5)
        _ticks(dog, 10)  # past the first deadline
        assert seen == [], seen
        assert dog.armed[other][0] > time.monotonic() + 900
        postpone(0.01)  # (earlier than the deadline: kept)
        assert dog.armed[me][0] > time.monotonic() + 2
        del dog.armed[me]
        postpone(5)
        assert me not in dog.armed  # (no deadline: none made)
        dog.armed[me] = (time.monotonic() + 0.05, "mine")  # the control: not postponed
        end = time.monotonic() + 10
        while not seen and time.monotonic() < end:
            _ticks(dog, 1)
        assert seen == ["mine"], seen
    finally:
        dog.stop()
