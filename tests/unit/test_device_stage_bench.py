"""bench/device_stage.py (served vs local stage, request batching, swapper vs resident) without a swarm:
argument defaults, the batching run file's arithmetic, the measurement window over trainer ledgers,
summaries, cores, ratios and tables from fake results; and, on tiny in this process, the local stage
measurement and the swapper row's code path (on CPU, where the bench itself skips that row)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.model.device import ComputeDevice

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("device_stage")


def test_defaults_and_quick_defaults():
    args = bench.parse_args([])
    assert (args.dtypes, args.trainers) == (["fp32", "bf16"], [1, 4, 8])
    assert (args.duration_s, args.warmup_s, args.local_duration_s) == (30.0, 5.0, 5.0)
    # --threads: None here, a server's own default once the device is known (main: server_threads)
    assert (args.device, args.threads, args.batch_micro_batch, args.max_batch_tokens) == ("auto", None, 2, 0)
    assert bench.parse_args(["--threads", "3"]).threads == 3
    assert args.in_flight == 0  # the trainer's own default
    assert (args.served_in_flight, args.rows) == ([0], ["served", "batching", "swap"])
    chosen = bench.parse_args(["--served-in-flight", "0, 16", "--rows", "served,swap"])
    assert (chosen.served_in_flight, chosen.rows) == ([0, 16], ["served", "swap"])
    quick = bench.parse_args(["--quick"])
    assert (quick.dtypes, quick.trainers, quick.duration_s, quick.warmup_s) == (["fp32"], [4], 10.0, 3.0)
    # --quick shortens what is not given; what is given stands
    mixed = bench.parse_args(
        ["--quick", "--trainers", "8, 1,4", "--dtypes", "bf16,fp32", "--duration-s", "7"]
    )
    assert (mixed.trainers, mixed.dtypes, mixed.duration_s) == ([1, 4, 8], ["fp32", "bf16"], 7.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtypes", "fp16"],
        ["--dtypes", ""],
        ["--trainers", "0,4"],
        ["--trainers", "four"],
        ["--duration-s", "0"],
        ["--warmup-s", "-1"],
        ["--threads", "0"],
        ["--max-batch-tokens", "-5"],
        ["--in-flight", "-1"],
        ["--served-in-flight", "4,-1"],
        ["--served-in-flight", "many"],
        ["--rows", "served,all"],
        ["--rows", ""],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2


def test_the_batching_run_splits_into_whole_micro_batches_for_every_trainer_count():
    assert bench.batching_global_batch(32, 2, [1, 4, 8]) == 32  # tiny's global batch already fits
    assert bench.batching_global_batch(32, 2, [3]) == 36  # 3 trainers x micro-batch 2: multiples of 6
    assert bench.batching_global_batch(32, 2, [1, 4, 32]) == 64
    assert bench.batching_global_batch(128, 8, [1]) == 128
    for counts in ([1, 4, 8], [3, 5], [6]):
        gb = bench.batching_global_batch(32, 2, counts)
        assert gb >= 32 and all(gb % (2 * n) == 0 for n in counts)


def test_batched_calls_take_at_least_four_micro_batches_or_one_per_trainer():
    assert [bench.batch_micro_batches(n) for n in (1, 4, 8)] == [4, 4, 8]
    assert bench.max_batch_tokens(2, 64, 4) == 512
    assert bench.max_batch_tokens(2, 64, bench.batch_micro_batches(8)) == 1024


def _done(t: float, n: int = 2) -> dict:
    return {"e": "done", "t": t, "mb": f"x-{t}", "n": n, "loss": 5.0}


def test_the_window_counts_completed_micro_batches_of_every_trainer():
    ledgers = [
        [{"e": "start", "t": 9.0, "n": 2}, _done(10.0), _done(11.0), _done(12.5), _done(15.0)],
        [_done(10.5, 4), {"e": "failed", "t": 11.5, "mb": "y"}, _done(14.0, 4), _done(20.0, 4)],
    ]
    assert bench.trainers_running(ledgers)
    # (10, 15]: trainer 0 at 11, 12.5, 15; trainer 1 at 10.5 and 14
    assert bench.window_samples(ledgers, 10.0, 15.0) == 3 * 2 + 2 * 4
    assert bench.window_samples(ledgers, 100.0, 200.0) == 0
    assert not bench.trainers_running([*ledgers, [{"e": "start", "t": 9.0, "n": 2}]])
    assert not bench.trainers_running([[], *ledgers])


def test_summaries_add_up_and_a_missing_one_is_counted():
    summaries = [
        {"microbatches_failed": 1, "retries": 3, "timeouts": 0, "samples": 10},
        None,
        {"microbatches_failed": 0, "retries": 2, "timeouts": 1},
    ]
    assert bench.summary_totals(summaries) == {"failed": 1, "retries": 5, "timeouts": 1, "missing": 1}


def test_cores_are_cpu_seconds_per_role_over_the_window():
    before = {"dht": 1.0, "stage0": 10.0, "stage1": 20.0, "trainer0": 5.0, "trainer1": 6.0}
    after = {"dht": 2.0, "stage0": 19.0, "stage1": 28.0, "trainer0": 7.0, "trainer1": 9.0}
    cores = bench.cores_used(before, after, 10.0)
    assert cores == pytest.approx({"dht": 0.1, "servers": 1.7, "trainers": 0.5})


def test_server_counters_come_from_the_last_whole_metrics_line():
    line = 'metrics {"stage":0,"backward":%d,"recomputed":%d,"batched_requests":%d,"bundles_sent":%d}'
    log = "\n".join(
        [
            "02:59:05 I swarmtrain.runtime.server.server_process: " + line % (10, 1, 4, 1),
            "02:59:10 I swarmtrain.runtime.server.server_process: " + line % (20, 3, 8, 2),
            '02:59:15 I swarmtrain.runtime.server.server_process: metrics {"stage":0,"backw',  # cut by a stop
            "02:59:16 I swarmtrain.runtime.server.server_process: stage 0 replica x stopping",
        ]
    )
    last = {"stage": 0, "backward": 20, "recomputed": 3, "batched_requests": 8, "bundles_sent": 2}
    assert bench.last_metrics(log) == last
    assert bench.last_metrics("no metrics here\n") is None
    older = {"backward": 5, "recomputed": 0}  # a server without the batching counters
    counts = bench.server_counts(m for m in [bench.last_metrics(log), older, None])  # read once
    assert counts == {
        "backward": 25,
        "recomputed": 3,
        "batched_requests": 8,
        "bundles_sent": 2,
        "samples_forward": None,
        "padded_samples": None,
    }
    assert set(bench.server_counts([None]).values()) == {None}


def test_local_spread_is_the_largest_relative_change_of_a_stage():
    assert bench.local_spread({"0": 100.0, "1": 50.0}, {"0": 100.0, "1": 150.0}) == pytest.approx(1.0)
    assert bench.local_spread({"0": 100.0}, {}) is None


def test_served_over_local_uses_the_slower_local_stage_averaged_before_and_after():
    entry = bench.served_entry(
        "fp32", 0, {"0": 100.0, "1": 80.0}, {"0": 120.0, "1": 60.0}, {"samples_per_s": 35.0, "label": "x"}
    )
    assert entry["local_samples_per_s"] == {"0": 110.0, "1": 70.0}
    assert entry["bottleneck_stage"] == "1"
    assert entry["served_over_local"] == pytest.approx(0.5)
    failed = bench.served_entry("bf16", 0, {"0": 1.0}, {"0": 1.0}, {"error": "RunFailed: boom", "label": "x"})
    assert failed["served_over_local"] is None
    assert bench.ratio(3.0, 0.0) is None and bench.ratio(None, 2.0) is None


def _run(
    sps: float | None,
    servers: float = 1.6,
    trainers: float = 0.3,
    error: str | None = None,
    shared: int = 0,
    recomputed: int = 0,
    bundles: int = 0,
    padded: int = 0,
) -> dict:
    if error:
        return {"error": error, "label": "8 trainer(s), batching on", "wall_s": 3.0}
    totals = {"failed": 0, "retries": 0, "timeouts": 0, "missing": 0}
    cores = {"servers": servers, "trainers": trainers, "dht": 0.01}
    servers = {
        "backward": 600,
        "recomputed": recomputed,
        "batched_requests": shared,
        "bundles_sent": bundles,
        "samples_forward": 1200,
        "padded_samples": padded,
    }
    return {
        "samples_per_s": sps,
        "samples": 300,
        "window_s": 10.0,
        "cores": cores,
        "totals": totals,
        "servers": servers,
    }


def fake_report(swap: dict) -> dict:
    setup = {
        "device": "cpu",
        "preset": "tiny",
        "num_stages": 2,
        "seq_len": 64,
        "micro_batch": 8,
        "batch_micro_batch": 2,
        "batch_global_batch": 32,
        "threads": 1,
        "duration_s": 30.0,
        "warmup_s": 5.0,
        "quick": False,
    }
    served = [
        bench.served_entry("fp32", 0, {"0": 900.0, "1": 1000.0}, {"0": 900.0, "1": 1000.0}, _run(450.0)),
        bench.served_entry("bf16", 16, {"0": 200.0, "1": 400.0}, {"0": 400.0, "1": 400.0}, _run(150.0)),
    ]
    batching = [
        bench.batching_entry(1, 512, _run(100.0), _run(110.0)),
        bench.batching_entry(
            4,
            512,
            _run(120.0, trainers=0.6),
            _run(180.0, trainers=0.6, shared=400, recomputed=250, bundles=90, padded=300),
        ),
        bench.batching_entry(8, 1024, _run(100.0), _run(None, error="RunFailed: trainer3 exited with 1")),
    ]
    return {
        "setup": setup,
        "served": served,
        "batching": batching,
        "local_batch_micro_batch": {"0": 400.0, "1": 500.0},
        "batched_call_micro_batches": 4,
        "local_batched_call": {"0": 800.0, "1": 1000.0},
        "swap": swap,
    }


def _row(lines: list[str], *first: str) -> list[str]:
    return next(line.split() for line in lines if line.split()[: len(first)] == list(first))


def test_shared_bound_is_the_harmonic_sum_of_the_stages():
    assert bench.shared_bound({"0": 100.0, "1": 100.0, "2": 50.0}) == pytest.approx(25.0)
    assert bench.shared_bound({"0": 100.0, "1": None}) is None and bench.shared_bound({}) is None


def test_tables_show_samples_ratios_cores_and_failures():
    lines = bench.report_lines(fake_report({"skipped": "device cpu: no accelerator"}))
    text = "\n".join(lines)
    # the shared-device bound of stages at 900 and 1000 samples/s: 1 / (1/900 + 1/1000) = 473.7
    fp32 = [
        "fp32",
        "900.0",
        "/",
        "1000.0",
        "default",
        "450.0",
        "0.500",
        "473.7",
        "0.950",
        "0%",
        "1.60/0.30",
        "0",
    ]
    assert _row(lines, "fp32") == fp32
    assert _row(lines, "bf16")[4:7] == ["16", "150.0", "0.500"]  # its trainer kept 16 micro-batches in flight
    # bf16's stage 0 read 200 before and 400 after: the machine was busy, and the table says so
    assert "! bf16: local before and after the swarm differ by up to 67%" in text
    assert "! fp32" not in text
    # stages at 400 and 500 samples/s share one device at 1 / (1/400 + 1/500) = 222.2
    one = ["1", "512", "100.0", "110.0", "1.10", "0.45", "0.50", "1.60/0.30", "1.60/0.30", "0/0", "0", "0"]
    assert _row(lines, "1", "512") == [*one, "0.00", "0/0"]
    assert _row(lines, "4", "512")[2:7] == ["120.0", "180.0", "1.50", "0.54", "0.81"]
    assert _row(lines, "4", "512")[-4:] == ["400", "90", "0.25", "0/250"]  # 300 padded of 1,200 samples
    eight = _row(lines, "8", "1024")
    assert eight[2:7] == ["100.0", "FAILED", "-", "0.45", "-"] and eight[-4:] == ["-", "-", "-", "0/-"]
    assert "trainer3 exited with 1" in text
    assert (
        "on/off >= 1.3 with 4+ trainers of micro-batch 2: NOT met (4: 1.50, 8: -)" in text
    )  # the failure's reason is printed under the table
    assert "at this micro-batch: 400.0 / 500.0; shared bound 222.2" in text
    # the model twice as fast in calls of 4 micro-batches: batching's gain on the device's arithmetic
    assert "in one call of 4 micro-batches: 800.0 / 1000.0; shared bound 444.4: the model alone 2.00x" in text
    assert "swapper vs resident: skipped (device cpu: no accelerator)" in text
    json.dumps(fake_report({"skipped": "x"}), allow_nan=False)


def test_the_batching_verdict_needs_every_row_of_4_trainers_or_more():
    report = fake_report({"skipped": "x"})
    report["batching"] = report["batching"][:2]
    assert bench.batching_verdict(report).endswith(": met (4: 1.50)")
    report["batching"][1]["on_over_off"] = 1.2
    assert "NOT met (4: 1.20)" in bench.batching_verdict(report)
    report["batching"] = report["batching"][:1]  # 1 trainer only: the criterion is not tested
    assert bench.batching_verdict(report) is None
    report["setup"]["batch_micro_batch"] = 8
    assert bench.batching_verdict(report) is None


def test_the_swap_row_prints_its_step_times_or_its_error():
    swap = {
        "micro_batch": 8,
        "budget_bytes": 64 * 2**20,
        "resident_peak_bytes": 128 * 2**20,
        "resident_ms": 4.0,
        "swapped_ms": 10.0,
        "swapped_over_resident": 2.5,
        "groups": 1,
        "last_graph_kept": True,
    }
    text = "\n".join(bench.report_lines(fake_report(swap)))
    assert "budget 64.0 MiB of a 128.0 MiB resident peak" in text
    assert "resident 4.00, swapped 10.00, swapped / resident 2.50" in text
    assert "1 group(s), the last one's forward graph kept (not recomputed)" in text
    text = "\n".join(bench.report_lines(fake_report({"error": "SwapPlanError: nothing fits"})))
    assert "swapper vs resident: FAILED: SwapPlanError: nothing fits" in text


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_local_stages_train_on_cpu(dtype, one_torch_thread):
    cfg = get_preset("tiny")
    compute = ComputeDevice(torch.device("cpu"), dtype)
    by_stage = bench.measure_local_stages(cfg, compute, micro_batch=2, duration_s=0.05)
    assert set(by_stage) == {"0", "1"} and all(v > 0 for v in by_stage.values())


def test_the_swap_row_runs_its_code_path_on_cpu(one_torch_thread):
    """The bench skips this row on CPU; its code (resident vs SwappedGPT) still runs here, on the host."""
    cfg = get_preset("tiny")
    swap = bench.measure_swap(cfg, torch.device("cpu"), micro_batch=2, steps=1, budget_bytes=float(1 << 30))
    assert swap["resident_ms"] > 0 and swap["swapped_ms"] > 0 and swap["resident_peak_bytes"] is None
    assert swap["swapped_over_resident"] == pytest.approx(swap["swapped_ms"] / swap["resident_ms"])
    assert swap["groups"] == 1 and swap["last_graph_kept"]  # 1 GiB holds all of `tiny`: nothing recomputed
    with pytest.raises(ValueError, match="budget"):
        bench.measure_swap(cfg, torch.device("cpu"), micro_batch=2, steps=1)
