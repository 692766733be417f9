"""Config: YAML + dotted overrides, round trip through plain dicts, errors that name the key."""

from __future__ import annotations

import pytest

from raytrain_loops.config import Config, ConfigError, load_config


def test_yaml_with_overrides_round_trips_through_a_plain_dict(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "optim: {name: sgd, momentum: 0.8}\n"
        "schedules:\n  lr: {kind: cosine, value: 0.1, warmup_steps: 5}\n  teacher_temp: 0.04\n"
        "precision: {dtype: bf16}\n"
    )
    cfg = load_config(recipe, ["accum.steps=4", "schedules.lr.end=1e-5", "optim.betas=[0.9, 0.95]", "ema.enabled=true"])
    assert cfg.optim.name == "sgd" and cfg.optim.momentum == 0.8 and cfg.optim.betas == [0.9, 0.95]
    assert cfg.schedules["lr"].kind == "cosine" and cfg.schedules["lr"].end == 1e-5
    assert cfg.schedules["teacher_temp"].value == 0.04  # a bare number is a constant schedule
    assert cfg.schedules["weight_decay"].value == 0.0  # defaults kept beside the recipe's entries
    assert cfg.accum.steps == 4 and cfg.ema.enabled is True and cfg.precision.dtype == "bf16"
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "override,key,fragment",
    [
        ("precision.dtype=fp8", "precision.dtype", "one of 'fp32', 'bf16', 'fp16', 'auto'"),
        ("optim.nme=sgd", "optim.nme", "did you mean 'name'"),
        ("nosuchsection.x=1", "nosuchsection", "unknown key. Known keys here: accum, "),
        # Keys from other trainers name ours.
        ("optim.lr=0.1", "optim.lr", "for optim.lr use schedules.lr.value (the learning rate is a schedule"),
        ("optim.weight_decay=0.01", "optim.weight_decay", "for optim.weight_decay use schedules.weight_decay.value"),
        ("trainer.max_epochs=3", "trainer", "for trainer.max_epochs use loop.epochs. Known keys here: "),
        ("batch_size=32", "batch_size", "for batch_size use data.batch_size (per worker)."),
        ("accum.steps=0", "accum.steps", "must be >= 1"),
        ("clip.max_norm=abc", "clip.max_norm", "must be a number"),
        ("schedules.lr.warmup_steps=1.5", "schedules.lr.warmup_steps", "must be an integer"),
        ("ema.enabled=maybe", "ema.enabled", "true or false"),
        ("schedules.lr=3", "schedules.lr", "is a section; set one of its keys, for example schedules.lr.value"),
        ("schedules.ema_momentum.value=1.5", "schedules.ema_momentum.value", "must be in [0, 1]"),
        ("optim.betas=[0.9]", "optim.betas", "two numbers"),
        ("freeze.last_layer_pattern=(", "freeze.last_layer_pattern", "not a regular expression"),
        ("loss.reduction", "loss.reduction", "key=value"),
        ("schedules.lr.kind=exp", "schedules.lr.kind", "'poly', 'step'"),
        ("schedules.lr.power=0", "schedules.lr.power", "must be > 0"),
        ("schedules.lr.per=iteration", "schedules.lr.per", "one of 'step', 'epoch'"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        (
            ["schedules.lr.warmup_steps=500"],
            "schedules.lr.warmup_steps",
            "per=epoch counts epochs: must be < loop.epochs=20",
        ),
        (["schedules.teacher_temp.warmup_steps=20"], "schedules.teacher_temp.warmup_steps", "must be < loop.epochs=20"),
        (
            ["schedules.lr.kind=step", "schedules.lr.milestones=[10,3000]"],
            "schedules.lr.milestones",
            "[3000] would never",
        ),
    ],
)
def test_per_epoch_schedules_count_warmup_and_milestones_in_epochs(overrides, key, fragment):
    base = ["loop.epochs=20", "schedules.lr.per=epoch", "schedules.teacher_temp.per=epoch"]
    assert load_config(None, [*base, "schedules.lr.warmup_steps=5"]).schedules["lr"].warmup_steps == 5
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, *overrides])
    assert info.value.key == key
    assert fragment in str(info.value)
    # With loop.max_steps the run's epochs depend on the data: left to the workers.
    assert load_config(None, [*base, *overrides, "loop.max_steps=100"]).loop.max_steps == 100


def test_bad_recipe_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such recipe file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="bad.yaml: must hold a mapping"):
        load_config(bad)
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  name: lamb\n")
    with pytest.raises(ConfigError, match=r"optim.name: must be one of 'adamw', 'adam', 'sgd'; got 'lamb'"):
        load_config(nested)


def test_a_task_argument_that_a_recipe_gives_as_a_mapping_takes_a_path_on_the_command_line():
    """hf_lm's ``model`` is an inline config in the recipe and a model directory when fine-tuning
    (docs/hf.md's command); a section of the config itself still refuses a bare value."""
    from raytrain_loops.recipes import resolve

    config = load_config(resolve("hf_lm"), ["task.params.model=my_model", "task.params.tokenizer=my_model"])
    assert config.task.params["model"] == "my_model" and config.task.params["tokenizer"] == "my_model"
    nested = load_config(resolve("hf_lm"), ["task.params.model.n_layer=1"])
    assert nested.task.params["model"]["n_layer"] == 1 and nested.task.params["model"]["model_type"] == "gpt2"
    with pytest.raises(ConfigError, match="is a section"):
        load_config(resolve("hf_lm"), ["precision=fp32"])


def test_preprocessing_resources_name_a_custom_resource_with_an_amount():
    """``data.preprocess.resources`` places the preprocessing tasks on nodes that advertise them;
    CPUs have their own key, and an amount of 0 would ask for nothing."""
    assert load_config(None, ["data.preprocess.resources={preprocess: 1}"]).data.preprocess.resources == {
        "preprocess": 1
    }
    assert load_config(None, []).data.preprocess.resources == {}
    for bad, key in (("{CPU: 1}", "CPU"), ("{preprocess: 0}", "preprocess")):
        with pytest.raises(ConfigError, match=rf"data\.preprocess\.resources\.{key}: must name a custom resource"):
            load_config(None, [f"data.preprocess.resources={bad}"])
