"""The monitor's page, charts and HTTP endpoints, on a fake history (no swarm, no browser)."""

import json
import socket
import threading
import urllib.request
from html.parser import HTMLParser

import pytest

from swarmtrain.cli.main import main
from swarmtrain.config.errors import UserError
from swarmtrain.monitor.charts import line_chart, nice_bounds, nice_ticks, stage_bars
from swarmtrain.monitor.history import SwarmHistory
from swarmtrain.monitor.page import PageMeta, render_page
from swarmtrain.monitor.web import build_app, server_url, start_http_server

pytestmark = pytest.mark.unit

LIVE = PageMeta("DHT via /ip4/127.0.0.1/tcp/1/p2p/X", refresh_s=2.0)


def snapshot(time_s, loss, stage1_peers=("B",), lost=0):
    def peer(peer_id, epoch):
        return {
            "peer_id": peer_id,
            "throughput_samples_per_s": 20.0,
            "queue": 1,
            "epoch": epoch,
            "state": "online",
            "same_config": True,
            "limit": "compute",
        }

    return {
        "run_id": "demo-run",
        "digest": "abc123",
        "time": time_s,
        "stages": [
            {"index": 0, "peers": [peer("QmPeerA", 4), peer("QmPeerC", 4)], "throughput_samples_per_s": 40.0},
            {"index": 1, "peers": [peer(p, 4) for p in stage1_peers], "throughput_samples_per_s": 20.0},
        ],
        "bottleneck": 1,
        "trainers": [
            {"trainer_id": "trainer", "loss": loss, "samples_per_s": 12.5, "samples": 256, "failed": 0}
        ],
        "replicas": [],
        "work": {"samples_lost": lost, "retries": 3},
        "rebalance": {
            "period_s": 60.0,
            "margin": 0.1,
            "plan": [{"peer_id": "QmPeerA", "from": 0, "to": 1, "expected_samples_per_s": 20.0}],
        },
    }


def filled_history():
    history = SwarmHistory()
    history.add(snapshot(1000.0, 3.1))
    history.add(snapshot(1002.0, 2.9, stage1_peers=("B", "QmNewPeer"), lost=8))
    return history


class Checker(HTMLParser):
    """Well-formedness enough for a browser: every opened non-void tag is closed, in order."""

    VOID = {"meta", "br", "img", "input", "link", "rect", "line", "circle", "polyline", "path"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors = [], []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_nice_ticks_and_charts():
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10] and nice_ticks(0, 97) == [0, 20, 40, 60, 80]
    assert nice_ticks(2.13, 2.91) == [2.2, 2.4, 2.6, 2.8]
    assert nice_bounds(2.2, 5.5) == (2.0, 6.0) and nice_bounds(0, 1712) == (0, 2000)  # a loss from ln(256)
    svg = line_chart(
        {"a": [(0, 1.0), (1, None), (2, 3.0), (3, 4.0)], "b": [(0, 2.0)]}, title="t", x_label="s"
    )
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 2  # a gap splits a; b is one point
    assert "no data yet" in line_chart({"a": [(0, None)]}, title="t", x_label="s")
    flat = line_chart({"a": [(0, 0), (5, 0)]}, title="t", x_label="s")
    assert 'class="tick">-' not in flat  # a counter at 0: no negative axis
    late = line_chart({"a": [(5, 1.0), (10, 2.0)]}, title="t", x_label="s", x_range=(0, 10))
    assert 'text-anchor="middle" class="tick">0</text>' in late  # the shared time axis starts at 0
    bars = stage_bars(snapshot(0, 1.0)["stages"], bottleneck=1)
    assert bars.count("<rect") == 2 and "#d62728" in bars and "20.0 bottleneck" in bars


def test_page_shows_stages_bottleneck_trainers_and_events():
    html = render_page(filled_history().view(), LIVE)
    checker = Checker()
    checker.feed(html)
    assert checker.errors == [] and checker.stack == []
    assert "<title>swarmtrain monitor: demo-run</title>" in html
    assert "id='stage-0' data-peers='2'" in html and "id='stage-1' data-peers='2'" in html
    assert "Stage 1: 2 peer(s), 20.0 samples/s <span class='bottleneck'>bottleneck</span>" in html
    assert "data-trainer='trainer'" in html and "<td class='num loss'>2.9</td>" in html
    assert "QmNewPeer joined stage 1 (online)" in html and "8 sample(s) of unapplied gradients lost" in html
    assert "fetch('fragment'" in html and "var periodMs = 2000;" in html
    # each server's limiting resource and the balancer's plan, as `swarmtrain status` shows them
    assert "<th>limited by</th>" in html and "<td>compute</td>" in html
    assert "rebalancing every 60 s: the plan is QmPeerA 0-&gt;1" in html
    assert "http://" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )  # nothing loaded from outside


def test_a_replay_page_is_static_and_says_simulated():
    html = render_page(filled_history().view(), PageMeta("replay of sim.json", None, simulated=True))
    assert "<script>" not in html and "simulated seconds" in html and "t=1002 s" in html


def test_a_page_before_the_first_snapshot():
    assert "waiting for the first snapshot" in render_page(SwarmHistory().view(), LIVE)


@pytest.fixture
def served():
    history = filled_history()
    server = start_http_server(build_app(history, LIVE), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server_url(server, "127.0.0.1"), server
    server.shutdown()
    server.server_close()
    thread.join(5)


def fetch(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers.get("Content-Type"), response.read().decode()


def test_endpoints(served):
    url, _ = served
    kind, body = fetch(url)
    assert kind.startswith("text/html") and "id='stage-1'" in body
    kind, body = fetch(url + "fragment")
    assert kind.startswith("text/html") and "<html" not in body and "id='stage-1'" in body
    kind, body = fetch(url + "api/swarm")
    data = json.loads(body)
    assert kind == "application/json" and data["polls"] == 2 and data["source"] == LIVE.source
    assert [len(s["peers"]) for s in data["snapshot"]["stages"]] == [2, 2]
    assert [p["trainers"]["trainer"]["loss"] for p in data["points"]] == [3.1, 2.9]
    kind, body = fetch(url + "metrics")
    assert kind.startswith("text/plain") and 'swarmtrain_trainer_loss{trainer="trainer"} 2.9' in body
    with pytest.raises(urllib.error.HTTPError) as err:
        fetch(url + "nope")
    assert err.value.code == 404


def test_a_port_in_use_is_a_user_error(served):
    _, server = served
    with pytest.raises(UserError, match=f"port {server.server_port} on 127.0.0.1 is already in use"):
        start_http_server(build_app(SwarmHistory(), LIVE), "127.0.0.1", server.server_port)


def run_cli(capsys, *argv):
    try:
        code = main(["monitor", *argv])
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_mistakes_are_one_line_errors(capsys, tmp_path):
    code, _, err = run_cli(capsys)
    assert code == 2 and "give --initial-peers (a running swarm) or --replay TIMELINE" in err
    code, _, err = run_cli(
        capsys, "--replay", str(tmp_path / "x.json"), "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/Q"
    )
    assert code == 2 and "drop --initial-peers" in err
    code, _, err = run_cli(capsys, "--port", "70000", "--replay", "x")
    assert code == 2 and "expected a TCP port number" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        replay = tmp_path / "t.json"
        frame = {"time": 1.0, "stages": [{"index": 0, "peers": [], "throughput_samples_per_s": 0.0}]}
        replay.write_text(json.dumps({"format": "swarmtrain-timeline", "frames": [frame]}))
        code, _, err = run_cli(capsys, "--replay", str(replay), "--port", str(taken.getsockname()[1]))
    assert code == 2 and "already in use; choose another --port" in err and "Traceback" not in err
