"""bench/host_path.py on a small preset: every step of a middle stage's host path runs on the real code
(the data plane's stream on 127.0.0.1, the seal, the codec) and the table adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_path.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_host_path", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_step_is_timed_and_the_table_adds_up(capsys):
    bench = _bench()
    rows = bench.measure("tiny", "8bit", "cpu", repeats=2)
    assert set(rows) == {*bench.OUTSIDE_CODEC, "decode", "encode"}
    assert all(ms >= 0 for ms in rows.values()) and rows["receive"] + rows["unseal"] > 0
    assert bench.main(["--preset", "tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "host, outside the codec and the model" in out and "codec arithmetic (decode + encode)" in out


def test_a_device_that_is_not_there_is_one_line(capsys):
    bench = _bench()
    assert bench.main(["--preset", "tiny", "--device", "no-such-device", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("host_path: ") and "\n" not in err.strip()
