import json

import pytest

from swarmtrain.cli.main import main

pytestmark = pytest.mark.unit


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "train-local", "dht", "server", "trainer", "plan", "simulate"):
        assert name in out


_STATUS = [
    "status",
    "--initial-peers",
    "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq",
]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train-local", "--preset", "huge"], "unknown preset 'huge'"),
        (["train-local", "--config", "/nonexistent.toml"], "config file not found"),
        (["train-local", "--data", "/nonexistent/texts", "--max-samples", "64"], "data path does not exist"),
        (["train-local", "--max-samples", "8"], "less than one global batch"),
        ([*_STATUS, "--run-key", "/nonexistent.key"], "cannot read run key"),
        ([*_STATUS, "--auto-relay", "--no-relay"], "contradict each other"),
        ([*_STATUS, "--announce-addr", "garbage"], "bad --announce-addr"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_bad_flag_value_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train-local", "--max-samples", "-3"])
    assert exc.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_train_local_learns_and_resumes(tmp_path, small_text_dir):
    config = tmp_path / "run.toml"
    config.write_text(
        "[training]\neval_every_samples = 128\neval_samples = 32\n[data]\nvalidation_fraction = 0.1\n"
    )
    common = [
        "train-local",
        "--config",
        str(config),
        "--data",
        str(small_text_dir),
        "--no-progress",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    assert main([*common, "--max-samples", "256", "--summary-json", str(tmp_path / "a.json")]) == 0
    first = json.loads((tmp_path / "a.json").read_text())
    assert first["samples"] == 256 and first["final_val_loss"] < first["initial_val_loss"] - 0.5
    # resume: continues from 256 samples, trains only the remaining 128
    assert main([*common, "--max-samples", "384", "--summary-json", str(tmp_path / "b.json")]) == 0
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["samples"] == 128
    assert second["initial_val_loss"] == pytest.approx(first["final_val_loss"], abs=1e-6)


def test_keygen_never_overwrites(tmp_path, capsys):
    key = tmp_path / "run.key"
    assert main(["keygen", str(key)]) == 0 and len(key.read_text().strip()) == 64
    assert main(["keygen", str(key)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_a_server_started_as_the_readme_does_rebalances_every_60_s():
    """Issue 40: rebalancing is on unless asked off. The server's run config gets the run file's period
    (60 s by default), and --rebalance-period-s sets a server's own (0: never move)."""
    from swarmtrain.cli.main import build_parser
    from swarmtrain.cli.server import _with_checkpoint_overrides
    from swarmtrain.config import get_preset

    cfg = get_preset("tiny")
    plain = build_parser().parse_args(
        ["server", "--preset", "tiny", "--stage", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"]
    )
    assert _with_checkpoint_overrides(cfg, plain).swarm.rebalance_period_s == 60.0
    off = build_parser().parse_args(
        [
            "server",
            "--preset",
            "tiny",
            "--stage",
            "0",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/X",
            "--rebalance-period-s",
            "0",
        ]
    )
    assert _with_checkpoint_overrides(cfg, off).swarm.rebalance_period_s == 0.0


_SERVER = ["server", "--preset", "tiny", "--stage", "1", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"]
_REPLICA = ["replica", "--preset", "tiny", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"]


@pytest.mark.parametrize("command", [_SERVER, _REPLICA], ids=["server", "replica"])
def test_a_peer_sets_its_own_state_download_rule_outside_the_run_digest(command):
    """Issue 55 item 4: a volunteer on a slow link lowers the minimum rate; the rule is the peer's own,
    so peers with other rules still agree on the run's digest."""
    from swarmtrain.cli.common import download_rule_from_args, run_config_from_args
    from swarmtrain.cli.main import build_parser
    from swarmtrain.planner.download_deadline import DEFAULT_RULE, DownloadRule

    plain = build_parser().parse_args(command)
    assert download_rule_from_args(plain) == DEFAULT_RULE
    home = build_parser().parse_args(
        [*command, "--state-download-min-mbit", "5", "--state-download-base-s", "0"]
    )
    assert download_rule_from_args(home) == DownloadRule(base_s=0.0, min_rate_bytes_per_s=625_000.0)
    assert run_config_from_args(home).digest() == run_config_from_args(plain).digest()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--state-download-min-mbit", "0", "expected a rate in Mbit/s > 0, got 0.0"),
        ("--state-download-min-mbit", "inf", "expected a rate in Mbit/s > 0, got inf"),
        ("--state-download-min-mbit", "fast", "expected a rate in Mbit/s > 0, got 'fast'"),
        ("--state-download-base-s", "-1", "expected seconds >= 0, got -1.0"),
        ("--state-download-base-s", "nan", "expected seconds >= 0, got nan"),
    ],
)
def test_a_bad_state_download_setting_is_one_error_line(capsys, flag, value, message):
    for command in (_SERVER, _REPLICA):
        with pytest.raises(SystemExit) as exc:
            main([*command, flag, value])
        assert exc.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and f"argument {flag}: {message}" in errors[0], errors


@pytest.mark.parametrize("command", ["server", "replica"])
def test_help_says_why_a_peer_would_set_its_state_download_rule(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--state-download-min-mbit M" in out and "--state-download-base-s S" in out
    assert "10 Mbit/s home link" in out and "not part of the run's config" in out
