"""Takes a swarm snapshot every `interval_s` on a daemon thread and feeds it to the history; a failed
poll is shown on the page (the DHT may be briefly unreachable) and the next one is tried on time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from swarmtrain.monitor.history import SwarmHistory
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


class Poller:
    def __init__(self, take_snapshot: Callable[[], dict], history: SwarmHistory, interval_s: float) -> None:
        self.take_snapshot = take_snapshot
        self.history = history
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="monitor-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started_s = time.monotonic()
            try:
                self.history.add(self.take_snapshot())
            except Exception as exc:  # keep polling: a transient DHT failure must not end the monitor
                logger.warning("swarm snapshot failed: %r", exc)
                self.history.record_error(repr(exc))
            # a period, not a pause: a slow DHT read does not stretch the time axis
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started_s)))
