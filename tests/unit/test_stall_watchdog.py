"""The stall watchdog: armed by the first completion, dumps real stacks once per stall, re-armed by the
next completion, silent while no trainer runs."""

import subprocess
import sys

import pytest

from swarmtrain.runtime.harness.stall_watchdog import StallWatchdog, _LedgerTail, py_spy_path

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def _done(path, mb: int, torn: bool = False) -> None:
    line = f'{{"e":"done","t":1.0,"mb":"m{mb}"}}'
    with open(path, "a") as f:
        f.write(line[:10] if torn else line + "\n")


def test_a_ledger_tail_counts_new_completions_and_waits_for_a_line_being_written(tmp_path):
    ledger = tmp_path / "trainer.ledger.jsonl"
    tail = _LedgerTail(ledger)
    assert tail.new_completions() == 0  # not created yet
    _done(ledger, 1)
    ledger.open("a").write('{"e":"start","t":1.0,"mb":"m2"}\n')
    _done(ledger, 2)
    assert tail.new_completions() == 2
    assert tail.new_completions() == 0
    with open(ledger, "a") as f:
        f.write('{"e":"do')  # half a line: not counted yet
    assert tail.new_completions() == 0
    with open(ledger, "a") as f:
        f.write('ne","t":1.0,"mb":"m3"}\n')
    assert tail.new_completions() == 1


@pytest.fixture
def sleeper():
    code = (
        "import time\ndef waiting_here():\n    print('in', flush=True)\n    time.sleep(600)\nwaiting_here()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "in\n"  # inside waiting_here: its frame is on the stack from now on
    yield proc
    proc.kill()
    proc.wait(10)
    proc.stdout.close()


@pytest.mark.skipif(py_spy_path() is None, reason="py-spy is not installed (a dev dependency)")
def test_one_dump_per_stall_with_every_processs_stacks(tmp_path, sleeper):
    ledger = tmp_path / "trainer.ledger.jsonl"
    running = {"trainer": True}
    seen = []
    dog = StallWatchdog(
        ledgers=lambda: [ledger],
        pids=lambda: {"sleeper": sleeper.pid},
        alive=lambda: running["trainer"],
        out_dir=tmp_path,
        quiet_s=10.0,
        on_dump=seen.append,
    )
    assert dog.poll(0.0) is None
    assert dog.poll(100.0) is None  # nothing completed yet: start-up is not a stall
    _done(ledger, 1)
    assert dog.poll(100.0) is None
    assert dog.poll(109.0) is None  # 9 s quiet
    path = dog.poll(110.5)
    assert path is not None and seen == [path] and dog.dumps == [path]
    text = path.read_text()
    assert text.startswith("no micro-batch completed for 10.5 s")
    assert f"sleeper (pid {sleeper.pid})" in text and "waiting_here" in text
    assert dog.poll(200.0) is None  # the same stall is dumped once
    _done(ledger, 2)
    assert dog.poll(201.0) is None
    assert dog.poll(212.0) is not None  # a new stall after a completion: dumped again
    assert [p.name for p in dog.dumps] == ["stall-1.txt", "stall-2.txt"]
    _done(ledger, 3)
    dog.poll(300.0)
    running["trainer"] = False
    assert dog.poll(400.0) is None  # no trainer running: nobody is waiting for completions
    running["trainer"] = True
    assert dog.poll(500.0) is None  # a new trainer starting up: armed again by its first completion
    _done(ledger, 4)
    dog.poll(501.0)
    assert dog.poll(512.0) is not None and len(dog.dumps) == 3


def test_without_py_spy_the_dump_says_so(tmp_path, monkeypatch):
    from swarmtrain.runtime.harness import stall_watchdog

    monkeypatch.setattr(stall_watchdog, "py_spy_path", lambda: None)
    assert "py-spy is not installed" in stall_watchdog.dump_stacks({"x": 1})
