"""`swarmtrain monitor --replay FILE`: a simulator timeline (`swarmtrain simulate --timeline-json FILE`)
loaded into the same history the live monitor fills, all at once, on the simulated time axis.

A timeline is {"format": "swarmtrain-timeline", "version": 1, "mode", "duration_s", "frames": [...]},
each frame shaped like the live snapshot (`monitor_snapshot`) with `time` in simulated seconds.
Anything else is refused with a message that says what the file is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

from swarmtrain.config.errors import UserError
from swarmtrain.monitor.history import SwarmHistory

TIMELINE_FORMAT = "swarmtrain-timeline"
HOW_TO_WRITE = "write one with `swarmtrain simulate ... --timeline-json FILE`"


def load_timeline(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--replay {path}: no such file ({HOW_TO_WRITE})") from None
    except IsADirectoryError:
        raise UserError(f"--replay {path} is a directory; give a timeline file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--replay {path}: not a JSON timeline ({exc}); {HOW_TO_WRITE}") from None
    except OSError as exc:
        raise UserError(f"--replay {path}: cannot read it ({exc.strerror})") from None
    if not isinstance(data, dict) or data.get("format") != TIMELINE_FORMAT:
        hint = (
            " (this looks like a --summary-json file)"
            if isinstance(data, dict) and "samples_per_s" in data
            else ""
        )
        raise UserError(f"--replay {path}: not a swarmtrain timeline{hint}; {HOW_TO_WRITE}")
    frames = data.get("frames")
    if not isinstance(frames, list) or not frames:
        raise UserError(f"--replay {path}: the timeline has no frames; {HOW_TO_WRITE}")
    for i, frame in enumerate(frames):
        problem = _frame_problem(frame)
        if problem:
            raise UserError(f"--replay {path}: frame {i} {problem}")
    return data


def _frame_problem(frame) -> str | None:
    if not isinstance(frame, dict):
        return "is not an object"
    if not isinstance(frame.get("time"), (int, float)):
        return "has no numeric `time`"
    stages = frame.get("stages")
    if not isinstance(stages, list) or not stages:
        return "has no `stages` list"
    for stage in stages:
        if not isinstance(stage, dict) or not isinstance(stage.get("peers"), list):
            return "has a stage without a `peers` list"
        if not isinstance(stage.get("index"), int) or not isinstance(
            stage.get("throughput_samples_per_s"), (int, float)
        ):
            return "has a stage without `index` and `throughput_samples_per_s`"
    return None


def replay_history(timeline: dict) -> SwarmHistory:
    """A history holding every frame of the timeline, events derived between consecutive frames."""
    frames = timeline["frames"]
    history = SwarmHistory(max_points=len(frames), max_events=max(500, 4 * len(frames)))
    for frame in frames:
        history.add(frame)
    return history
