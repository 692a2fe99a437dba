"""Replay: `swarmtrain simulate --timeline-json` frames, shaped like the live snapshot, loaded by
`swarmtrain monitor --replay`; bad files are refused with one line."""

import dataclasses
import json

import pytest
from test_monitor_history import FakeRecords

from swarmtrain.cli.main import main
from swarmtrain.config import get_preset
from swarmtrain.config.errors import UserError
from swarmtrain.monitor.replay import load_timeline, replay_history
from swarmtrain.monitor.snapshot import monitor_snapshot
from swarmtrain.sim import runner
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.churn import churn_schedule
from swarmtrain.sim.fleet import FleetError, synthetic_fleet
from swarmtrain.sim.timeline import run_with_timeline, timeline_document

pytestmark = pytest.mark.unit

QUICK = ["--duration-s", "600", "--chunk-samples", "32", "--global-batch-size", "8192"]


def small_run(mode="swarm", num_samples=20):
    fleet = synthetic_fleet(24, 0)
    config = SimConfig(mode=mode, duration_s=600.0, chunk_samples=32, num_samples=num_samples)
    schedule = churn_schedule("preemptible", fleet, 600.0, 0)
    return run_with_timeline(fleet, get_preset("gpt3-xl"), config, schedule, 8192)


def test_frames_have_the_live_snapshot_shape_and_follow_the_run():
    result, frames = small_run()
    assert len(frames) == 20 and [f["time"] for f in frames] == result.series["time_s"]
    live = monitor_snapshot(get_preset("tiny"), FakeRecords({}))
    for frame in frames:
        assert set(frame) == set(live)
        assert set(frame["work"]) == set(live["work"])
        assert set(frame["rebalance"]) == set(live["rebalance"])
        assert all(
            set(p)
            == {
                "peer_id",
                "throughput_samples_per_s",
                "limit",
                "queue",
                "epoch",
                "state",
                "same_config",
                "addresses",
            }
            for s in frame["stages"]
            for p in s["peers"]
        )
    last = frames[-1]
    assert last["trainers"][0]["samples"] == int(result.summary["samples"])
    assert last["work"]["samples_lost"] == result.summary["samples_lost"]
    assert last["work"]["state_downloads"] == result.summary["joins"] + result.summary["moves"]
    assert [f["trainers"][0]["samples_per_s"] for f in frames] == pytest.approx(
        result.series["samples_per_s"]
    )
    plain = runner.run_simulation(
        synthetic_fleet(24, 0),
        get_preset("gpt3-xl"),
        SimConfig(mode="swarm", duration_s=600.0, chunk_samples=32, num_samples=20),
        churn_schedule("preemptible", synthetic_fleet(24, 0), 600.0, 0),
        8192,
    )
    assert plain.summary == result.summary  # recording frames changes nothing in the run


def test_a_timeline_of_a_misplaced_fleet_or_of_replicas_is_refused():
    fleet = synthetic_fleet(4, 0)
    misplaced = dataclasses.replace(
        fleet, peers=(dataclasses.replace(fleet.peers[0], stage=99), *fleet.peers[1:])
    )
    with pytest.raises(FleetError, match="stage 99"):
        run_with_timeline(misplaced, get_preset("gpt3-xl"), SimConfig(duration_s=10.0))
    with pytest.raises(ValueError, match="pipeline modes"):
        run_with_timeline(fleet, get_preset("gpt3-xl"), SimConfig(mode="async-replicas", duration_s=10.0))


def test_a_replay_derives_events_from_frames(tmp_path):
    _, frames = small_run()
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(timeline_document(frames, "swarm", 600.0, "24 peers")))
    history = replay_history(load_timeline(path))
    view = history.view()
    assert view["polls"] == 20 and len(view["points"]) == 20
    assert view["events"][0]["kind"] == "start"
    counts = view["event_counts"]
    assert counts.get("leave", 0) + counts.get("move", 0) + counts.get("join", 0) > 0  # preemptible churn


def test_simulate_writes_a_timeline_the_monitor_accepts(tmp_path, capsys):
    path = tmp_path / "t.json"
    code = main(
        ["simulate", "--num-peers", "24", "--churn", "exponential", *QUICK, "--timeline-json", str(path)]
    )
    out = capsys.readouterr().out
    assert code == 0 and f"timeline: {path} (120 frames" in out
    timeline = load_timeline(path)
    assert timeline["mode"] == "swarm" and "churn exponential" in timeline["description"]


@pytest.mark.parametrize("extra", [["--mode", "all"], ["--mode", "async-replicas"], ["--choose-mode"]])
def test_simulate_refuses_a_timeline_without_stages(tmp_path, capsys, extra):
    code = main(["simulate", "--num-peers", "8", *QUICK, "--timeline-json", str(tmp_path / "t.json"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and "--timeline-json" in err and not (tmp_path / "t.json").exists()


FRAME = {"time": 1.0, "stages": [{"index": 0, "peers": [], "throughput_samples_per_s": 0.0}]}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("{not json", "not a JSON timeline"),
        (
            json.dumps({"samples_per_s": 3.0}),
            r"not a swarmtrain timeline \(this looks like a --summary-json file\)",
        ),
        (json.dumps({"format": "swarmtrain-timeline", "frames": []}), "the timeline has no frames"),
        (
            json.dumps({"format": "swarmtrain-timeline", "frames": [FRAME, {"time": 2}]}),
            "frame 1 has no `stages`",
        ),
        (
            json.dumps({"format": "swarmtrain-timeline", "frames": [{"stages": []}]}),
            "frame 0 has no numeric `time`",
        ),
    ],
)
def test_bad_replay_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_timeline(path)


def test_a_bad_replay_file_on_the_command_line_is_one_line(tmp_path, capsys):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"samples_per_s": 3.0}))
    assert main(["monitor", "--replay", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "swarmtrain simulate ... --timeline-json FILE" in err
