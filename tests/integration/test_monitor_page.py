"""`swarmtrain monitor` against a live local swarm: /api/swarm and /metrics carry the stages, the
bottleneck and the trainer's loss, and headless Chromium renders the page with them.

Set SWARMTRAIN_MONITOR_SCREENSHOT=PATH to keep the page's screenshot (docs/monitor.png is made so).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmtrain.runtime.procs import ManagedProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

CHROMIUM = "/usr/bin/chromium"


def wait_for(what: str, check, timeout_s: float, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(period_s)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def start_monitor(swarm, log_path: Path) -> ManagedProcess:
    argv = [sys.executable, "-m", "swarmtrain.cli.main", "monitor", "--config", swarm.config_path]
    argv += ["--initial-peers", swarm.address, "--port", "0", "--interval-s", "1"]
    argv += ["--url-file", str(log_path.with_suffix(".url"))]
    return ManagedProcess("monitor", argv, log_path, env=swarm.env)


def monitor_url(monitor: ManagedProcess, url_file: Path) -> str:
    def found():
        assert monitor.alive, monitor.log_text()[-3000:]
        return url_file.read_text().strip() if url_file.exists() else None

    return wait_for("the monitor's URL", found, timeout_s=60, period_s=0.2)


def trained(url: str):
    """/api/swarm once both stages have their server and the trainer has published a loss."""
    data = json.loads(fetch(url + "api/swarm"))
    snapshot = data["snapshot"] or {}
    peers = [len(s["peers"]) for s in snapshot.get("stages", [])]
    trainers = [t for t in snapshot.get("trainers", []) if t["trainer_id"] == "trainer"]
    if peers == [1, 1] and trainers and trainers[0]["loss"] is not None and len(data["points"]) >= 3:
        return data
    return None


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    command += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    command += [f"--user-data-dir={profile}", "--virtual-time-budget=3000", "--hide-scrollbars", *args, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_monitor_serves_the_live_swarm(make_swarm, tmp_path):
    swarm, cfg = make_swarm("tiny")
    swarm.start_dht()
    swarm.start_server("s0", 0)
    swarm.start_server("s1", 1)
    monitor = start_monitor(swarm, tmp_path / "monitor.log")  # starts while the servers build their stages
    try:
        url = monitor_url(monitor, tmp_path / "monitor.url")
        swarm.wait_ready(["s0", "s1"])
        swarm.start_trainer("trainer", "--max-samples", "100000", "--in-flight", "2", "--log-period-s", "1")
        data = wait_for("the trainer's loss in /api/swarm", lambda: trained(url), timeout_s=60)
        check_api(data, cfg)
        check_metrics(fetch(url + "metrics"))
        check_page(url, tmp_path)
        monitor.proc.terminate()  # SIGTERM: a clean stop, exit code 0
        assert monitor.proc.wait(timeout=20) == 0 and "monitor: stopped" in monitor.log_text()
    finally:
        monitor.stop(grace_s=5)  # whatever is left of its process group (the DHT fork, p2pd)


def check_api(data: dict, cfg) -> None:
    snapshot = data["snapshot"]
    assert snapshot["run_id"] == cfg.swarm.run_id and snapshot["digest"] == cfg.digest()
    assert data["source"].startswith("DHT via /ip4/127.0.0.1/") and data["error"] is None
    for stage in snapshot["stages"]:
        (peer,) = stage["peers"]
        assert peer["same_config"] and peer["state"] == "online" and isinstance(peer["epoch"], int)
    assert snapshot["bottleneck"] in (0, 1)
    (trainer,) = snapshot["trainers"]
    # a byte-level model starts near ln(256) = 5.5 and only goes down from there
    assert 0 < trainer["loss"] < 6.0 and trainer["samples"] > 0
    kinds = [e["kind"] for e in data["events"]]
    assert kinds[0] == "start" and "trainer_join" in kinds  # the trainer started after the monitor
    losses = [p["trainers"]["trainer"]["loss"] for p in data["points"] if "trainer" in p["trainers"]]
    assert losses and losses[-1] == trainer["loss"]


def check_metrics(text: str) -> None:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("swarmtrain_stage_peers", (("stage", "0"),))] == 1
    assert samples[("swarmtrain_stage_peers", (("stage", "1"),))] == 1
    assert 0 < samples[("swarmtrain_trainer_loss", (("trainer", "trainer"),))] < 6.0
    assert samples[("swarmtrain_trainer_samples_total", (("trainer", "trainer"),))] > 0
    assert samples[("swarmtrain_monitor_polls_total", ())] >= 3
    assert sum(v for (name, _), v in samples.items() if name == "swarmtrain_stage_is_bottleneck") == 1


def check_page(url: str, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium): the API checks above passed")
    shot = tmp_path / "monitor.png"
    with ThreadPoolExecutor(2) as pool:  # the page's DOM and its screenshot side by side (~2 s each)
        dom_run = pool.submit(chromium, url, tmp_path / "profile-dom", "--dump-dom")
        shot_args = (f"--screenshot={shot}", "--window-size=1280,1300")
        shot_run = pool.submit(chromium, url, tmp_path / "profile-shot", *shot_args)
        dom, result = dom_run.result(), shot_run.result()
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert re.search(r'<section class="panel stage" id="stage-0" data-peers="1">', html), html[:3000]
    assert 'id="stage-1" data-peers="1"' in html
    assert '<span class="bottleneck">bottleneck</span>' in html
    loss = re.search(
        r'<tr class="trainer" data-trainer="trainer">.*?<td class="num loss">([0-9.]+)</td>', html
    )
    assert loss and 0 < float(loss.group(1)) < 6.0
    assert "trainer trainer started" in html and "<svg" in html and "training loss per trainer" in html
    assert result.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", result.stderr[-2000:]
    keep = os.environ.get("SWARMTRAIN_MONITOR_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
