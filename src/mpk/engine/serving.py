"""The serving loop: a background thread that runs the scheduler while requests come and go.

`submit` may be called from any thread; the loop admits requests between launches and hands
tokens to their handles as each launch finishes. `stop(drain=True)` refuses new requests and
returns once every admitted and waiting request has finished; `stop(drain=False)` cancels them.
A failing launch (a kernel error) ends every request with the error and stops the loop: the
engine's executor cannot be trusted after that.
"""

from __future__ import annotations

import logging
import threading

from mpk.engine.requests import RequestHandle
from mpk.engine.scheduler import Scheduler
from mpk.errors import MpkError

log = logging.getLogger(__name__)


class EngineStoppedError(MpkError):
    """The engine is stopping or stopped (or broke): it takes no new requests."""


class ServingLoop:
    def __init__(self, scheduler: Scheduler, name: str = "mpk-engine") -> None:
        self.scheduler = scheduler
        self._cv = threading.Condition()
        self._stopping = False
        self._drain = True
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return not self._stopping and self.error is None

    def submit(self, handle: RequestHandle) -> RequestHandle:
        with self._cv:
            if self.error is not None:
                raise EngineStoppedError(f"the engine stopped after an error: {self.error}")
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down and takes no new requests")
            self.scheduler.submit(handle)
            self._cv.notify()
        return handle

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        with self._cv:
            self._stopping = True
            self._drain = drain
            self._cv.notify()
        if not drain:
            self._cancel_all()
        self._thread.join(timeout)

    def _cancel_all(self) -> None:
        self.scheduler.cancel_all()  # retired at the loop's next step

    def _run(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not sched.has_work() and not self._stopping:
                    self._cv.wait(0.1)
                if not sched.has_work() and self._stopping:
                    return
            try:
                sched.step()
            except Exception as e:  # a launch failed: no request may wait forever
                self.error = f"{type(e).__name__}: {e}"
                log.error("engine launch failed, ending every request: %s", self.error)
                sched.fail_all(self.error)
                return

