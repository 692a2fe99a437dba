"""Stopping a peer whose libp2p daemon died first (a Ctrl-C to its process group): hivemind's daemon
bindings fail in tasks nobody awaits, and those failures are logged at debug instead of printed as
tracebacks; every other unhandled task exception still reaches asyncio's default handler."""

import asyncio
import gc
import os

import pytest

from swarmtrain.net.engine import StopTolerantLoopPolicy, shutdown_quietly

pytestmark = pytest.mark.unit


def _coroutine_function_in(path: str):
    """An async function whose code says it lives in `path` (as hivemind's own would)."""
    namespace: dict = {}
    source = "async def write():\n    raise ConnectionResetError('Connection lost')\n"
    exec(compile(source, path, "exec"), namespace)
    return namespace["write"]


def _unretrieved_failures(*coroutines) -> list[dict]:
    """Run each coroutine as a task nobody awaits; what reaches asyncio's default handler."""
    loop = StopTolerantLoopPolicy().new_event_loop()
    reported: list[dict] = []
    loop.default_exception_handler = reported.append  # type: ignore[method-assign]
    try:
        for coroutine in coroutines:
            task = loop.create_task(coroutine)
            loop.run_until_complete(asyncio.sleep(0.01))
            del task
            gc.collect()  # "exception was never retrieved" is reported when the task is collected
    finally:
        loop.close()
    return reported


def test_a_daemon_binding_that_lost_its_daemon_is_quiet_and_anything_else_is_reported():
    in_hivemind = _coroutine_function_in(os.path.join(os.sep, "x", "hivemind", "p2p", "control.py"))
    elsewhere = _coroutine_function_in(os.path.join(os.sep, "x", "swarmtrain", "runtime", "ours.py"))

    async def a_bug_of_ours_in_hivemind_code_paths():
        raise ValueError("not a lost daemon")

    reported = _unretrieved_failures(in_hivemind(), elsewhere(), a_bug_of_ours_in_hivemind_code_paths())
    assert [type(c["exception"]).__name__ for c in reported] == ["ConnectionResetError", "ValueError"]


def test_shutdown_quietly_skips_a_component_whose_process_is_gone():
    class Gone:
        shut = False

        def is_alive(self) -> bool:
            return False

        def shutdown(self) -> None:
            self.shut = True  # hivemind logs an ERROR with no exception when asked this

    gone = Gone()
    shutdown_quietly(gone, None)
    assert not gone.shut


def test_a_stream_handler_cancelled_on_stop_is_quiet_and_other_callback_failures_are_reported():
    """A connection handler task cancelled by a stop (Python 3.11 asks it for its exception and logs
    "Exception in callback StreamReaderProtocol.connection_made...(CancelledError)"): nothing reaches
    asyncio's default handler. A callback that fails otherwise still does."""
    loop = StopTolerantLoopPolicy().new_event_loop()
    reported: list[dict] = []
    loop.default_exception_handler = reported.append  # type: ignore[method-assign]
    handling = asyncio.Event()

    async def handler(reader, writer):
        handling.set()
        await asyncio.sleep(60)

    async def scenario():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(handling.wait(), 5)
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()  # what a stop does to the daemon bindings' handlers
        await asyncio.sleep(0.05)
        loop.call_soon(lambda: 1 / 0)
        await asyncio.sleep(0.05)
        writer.close()
        server.close()

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert [type(c.get("exception")).__name__ for c in reported] == ["ZeroDivisionError"], reported
