import dataclasses

import pytest

from swarmtrain.config import ConfigError, get_preset, load_run_config, partition_layers, preset_names, sizes

pytestmark = pytest.mark.unit


def test_presets_build_and_have_distinct_digests():
    digests = {get_preset(name).digest() for name in preset_names()}
    assert len(digests) == len(preset_names())
    assert get_preset("tiny").digest() == get_preset("tiny").digest()


def test_unknown_preset_names_choices():
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*tiny"):
        get_preset("huge")


def test_toml_overrides_and_digest_changes(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'preset = "tiny"\n[model]\nd_model = 128\n[training]\nmax_samples = 64\nlearning_rate = 1\n'
    )
    cfg = load_run_config(path)
    assert cfg.model.d_model == 128 and cfg.training.max_samples == 64 and cfg.training.learning_rate == 1.0
    assert cfg.digest() != get_preset("tiny").digest()


def test_digest_ignores_local_only_fields(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\neval_every_samples = 64\neval_samples = 7\n[swarm]\ncompression = 'none'\n")
    assert load_run_config(path).digest() == get_preset("tiny").digest()


def _with_training(cfg, **changes):
    return cfg.replace(training=dataclasses.replace(cfg.training, **changes))


def test_digest_covers_the_seed(tiny_cfg):
    # replicas of a stage initialize their weights from the seed
    assert _with_training(tiny_cfg, seed=tiny_cfg.training.seed + 1).digest() != tiny_cfg.digest()


def test_digest_covers_max_samples(tiny_cfg):
    # max_samples is the cosine horizon: peers differing in it step with different learning rates
    changed = _with_training(tiny_cfg, max_samples=tiny_cfg.training.max_samples * 2)
    assert changed.digest() != tiny_cfg.digest()


def test_digest_ignores_eval_samples(tiny_cfg):
    changed = _with_training(tiny_cfg, eval_samples=tiny_cfg.training.eval_samples + 1)
    assert changed.digest() == tiny_cfg.digest()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[model]\nwidth = 3\n", "unknown field model.width"),
        ("[model]\nd_model = 'big'\n", "model.d_model: expected int, got str"),
        ("[model]\nd_model = 66\n", "divisible by model.num_heads"),
        ("[training]\nmicro_batch_size = 0\n", "training.micro_batch_size must be positive"),
        ("[swarm]\ncompression = 'zip'\n", "swarm.compression must be one of"),
        ("[swarm]\nnum_stages = 9\n", "cannot cut 4 layers into 9 stages"),
        ("colour = 1\n", "unknown top-level key"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_bad_toml_names_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_run_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(tmp_path / "nope.toml")


def test_partition_even_explicit_and_errors():
    assert [(s.layer_start, s.layer_end) for s in partition_layers(10, 4)] == [
        (0, 3),
        (3, 6),
        (6, 8),
        (8, 10),
    ]
    assert [(s.layer_start, s.layer_end) for s in partition_layers(10, 2, [7, 3])] == [(0, 7), (7, 10)]
    with pytest.raises(ConfigError, match="sum to 10"):
        partition_layers(10, 2, [5, 4])


def test_size_math_matches_a_hand_count_and_gpt3_xl():
    tiny = get_preset("tiny").model
    d, ff = tiny.d_model, tiny.d_ff
    assert sizes.params_per_layer(tiny) == 4 * d + 4 * d * d + 4 * d + 2 * d * ff + ff + d
    stages = get_preset("tiny").stages()
    assert sum(sizes.params_per_stage(tiny, s) for s in stages) == sizes.total_params(tiny)
    xl = get_preset("gpt3-xl")
    assert sizes.params_per_layer(xl.model) == pytest.approx(12 * 2048**2, rel=0.01)
    assert sizes.activation_bytes_per_sample(xl.model) == 2048 * 2048 * 2
    middle = xl.stages()[3]
    assert sizes.params_per_stage(xl.model, middle) == 3 * sizes.params_per_layer(xl.model)
    assert 1.2e9 < sizes.total_params(xl.model) < 1.5e9


def _variants(cfg):
    """Configs around `cfg`, each changing one thing the digest does or does not take."""
    swarm, model = cfg.swarm, cfg.model
    return {
        "base": cfg,
        "4bit": cfg.replace(swarm=dataclasses.replace(swarm, compression="4bit")),
        "2bit-rht": cfg.replace(swarm=dataclasses.replace(swarm, compression="2bit-rht")),
        "none": cfg.replace(swarm=dataclasses.replace(swarm, compression="none")),  # same digest as 8bit
        "float16": cfg.replace(swarm=dataclasses.replace(swarm, compression="float16")),
        "d_model": cfg.replace(model=dataclasses.replace(model, d_model=model.d_model * 2)),
        "seed": _with_training(cfg, seed=cfg.training.seed + 1),
        "eval": _with_training(cfg, eval_samples=cfg.training.eval_samples + 1),  # same digest
        "local_steps": cfg.replace(swarm=dataclasses.replace(swarm, local_steps=2)),
        "llama": get_preset("llama-tiny"),
    }


def test_the_settings_summary_names_exactly_what_makes_two_digests_differ(tiny_cfg):
    from swarmtrain.config.run import differing_settings

    variants = _variants(tiny_cfg)
    for a_name, a in variants.items():
        for b_name, b in variants.items():
            differ = differing_settings(a.settings_summary(), b.settings_summary())
            assert bool(differ) == (a.digest() != b.digest()), (a_name, b_name, differ)
    base, four = variants["base"].settings_summary(), variants["4bit"].settings_summary()
    assert differing_settings(four, base) == [("swarm.compression", '"4bit"', '"8bit"')]
    assert differing_settings(base, variants["d_model"].settings_summary()) == [
        ("model.d_model", "64", "128")
    ]
    local = differing_settings(base, variants["local_steps"].settings_summary())
    assert ("swarm.local_steps", "default", "2") in local  # a setting the digest takes only when set
    summary = variants["llama"].settings_summary()
    assert summary["model.arch"] == '"llama"' and summary["swarm.compression"] == '"8bit"'
    assert all(len(v) <= 64 for v in summary.values())


def test_a_long_setting_is_summarized_by_a_prefix_and_a_hash(tiny_cfg):
    many = tiny_cfg.replace(
        model=dataclasses.replace(tiny_cfg.model, num_layers=40),
        swarm=dataclasses.replace(tiny_cfg.swarm, num_stages=20),
    )
    other = many.replace(swarm=dataclasses.replace(many.swarm, layers_per_stage=(1,) * 19 + (21,)))
    stages = many.settings_summary()["swarm.stages"]
    assert len(stages) <= 64 and "...#" in stages
    assert other.settings_summary()["swarm.stages"] != stages  # another cut, another summary
