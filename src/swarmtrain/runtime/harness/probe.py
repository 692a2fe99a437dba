"""An in-process client of a running swarm, for tests and benchmarks: a client-mode DHT, a trainer
(no data loop) and an asyncio loop on a background thread. Every call has a timeout.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

from swarmtrain.config import RunConfig
from swarmtrain.net.engine import PeerNetwork, shutdown_quietly, start_dht
from swarmtrain.net.protocol import Message
from swarmtrain.runtime.procs import descendants, hivemind_socket_paths, remove_files
from swarmtrain.runtime.trainer.swarm_trainer import SwarmTrainer, TrainerOptions


class SwarmProbe:
    def __init__(
        self,
        cfg: RunConfig,
        initial_peers: list[str],
        codec: str = "none",
        timeout_s: float = 60.0,
        network: PeerNetwork | None = None,
    ):
        self.cfg, self.timeout_s = cfg, timeout_s
        network = network or PeerNetwork()
        self.dht = start_dht(initial_peers, network, client_mode=True)
        self._sockets = self._own_sockets()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="probe-loop", daemon=True)
        self._thread.start()
        self.trainer = SwarmTrainer(
            cfg, TrainerOptions(codec=codec, trainer_id="probe", network=network), self.dht
        )
        self.run(self.trainer.setup())

    def run(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s or self.timeout_s)

    def wait_for_peers(self, counts: list[int], timeout_s: float = 60.0) -> None:
        """Until stage i has at least counts[i] live servers in our view."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.run(self.trainer.caller.refresh())
            have = self.trainer.table.peers_per_stage()
            if all(h >= c for h, c in zip(have, counts, strict=True)):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers per stage {have}, wanted {counts}")
            time.sleep(0.3)

    def peers(self, stage: int) -> list[str]:
        return sorted(self.trainer.table.announcements[stage])

    def set_codec(self, codec: str) -> None:
        """Every later call of this probe sends with `codec`, the direct hand-off's chain included."""
        self.trainer.codec = self.trainer.caller.codec = codec
        if self.trainer.chain is not None:
            self.trainer.chain.codec = codec

    def forward_backward(self, mb: str, input_ids, labels, step: int = 0) -> float:
        """One micro-batch of `step`, accumulated but never closed (its sums stay inspectable)."""
        return self.run(self.trainer.forward_backward(mb, step, input_ids, labels))

    def silent(self, stage: int, peers: list[str], timeout_s: float = 2.0) -> list[str]:
        """Those of `peers` (of `stage`) that do not answer a `ping` within `timeout_s` (frozen)."""
        pairs = [(stage, peer) for peer in peers]
        return [peer for _, peer in self.run(self.trainer.caller.silent_peers(pairs, timeout_s))]

    def info(self, peer: str, want: str | None = None) -> Message:
        header = {"want": want} if want else {}
        client = self.trainer.client
        return self.run(client.call(peer, Message("info", header), self.timeout_s))

    def call_raw(self, peer: str, kind: str, data: bytes, attempts: int = 3) -> Message:
        """Like a trainer, retry when the transport cut the exchange short: on a loaded machine a
        hivemind stream can end with no reply, or break during a large upload, whatever the handler did."""
        from swarmtrain.net.transport import TruncatedReply

        def call() -> Message:
            return self.run(self.trainer.client.call_raw(peer, kind, data, self.timeout_s))

        for _ in range(attempts - 1):
            try:
                return call()
            except (TruncatedReply, ConnectionError):
                pass
        return call()

    async def _close_async(self) -> None:
        await self.trainer.client.p2p.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _own_sockets(self) -> set[str]:
        """Sockets of this process and of our DHT's process tree (not of other children, e.g. servers
        a test started)."""
        return hivemind_socket_paths([os.getpid(), self.dht.pid, *descendants(self.dht.pid)])

    def close(self) -> None:
        """Idempotent: a test may close early and its fixture again at teardown."""
        if self.loop.is_closed():
            return
        self._sockets |= self._own_sockets()
        try:
            self.run(self._close_async(), timeout_s=10)
        except Exception:  # best effort: the loop is stopped below anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
        shutdown_quietly(self.dht)
        remove_files(self._sockets)
