"""`--identity-path` keeps a peer's id across restarts: a bootstrap DHT restarted on the same port
has the same address, so every other peer's --initial-peers stays valid."""

import socket

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_restarted_bootstrap_keeps_its_address_and_peers_rejoin(make_swarm, tmp_path):
    key, port = tmp_path / "keys" / "dht.key", str(_free_port())
    swarm, cfg = make_swarm("tiny")
    first = swarm.start_dht("--identity-path", str(key), "--port", port)
    assert key.is_file()
    swarm.stop_all()

    again, _ = make_swarm("tiny")
    second = again.start_dht("--identity-path", str(key), "--port", port)
    assert second == first
    # a server started with the old address joins the restarted bootstrap
    again.start_server("s1", 1, "--identity-path", str(tmp_path / "keys" / "s1.key"))
    again.wait_ready(["s1"])
    peer_id = again.ledger_events("s1", "ready")[0]["peer"]
    again.stop_all()
    assert (tmp_path / "keys" / "s1.key").is_file()

    third, _ = make_swarm("tiny")
    third.start_dht("--identity-path", str(key), "--port", port)
    third.start_server("s1", 1, "--identity-path", str(tmp_path / "keys" / "s1.key"))
    third.wait_ready(["s1"])
    assert f"replica {peer_id} ready" in third.processes["s1"].log_text()


def test_an_identity_path_that_is_a_directory_is_a_clear_error(make_swarm, tmp_path):
    from swarmtrain.runtime.harness.local_swarm import SwarmStartError

    swarm, _ = make_swarm("tiny")
    with pytest.raises(SwarmStartError, match="is a directory; give a file name"):
        swarm.start_dht("--identity-path", str(tmp_path), timeout_s=30)
    assert "Traceback" not in swarm.processes["dht"].log_text()
