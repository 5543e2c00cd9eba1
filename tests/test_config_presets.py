"""Config loading: the presets hold the chapter's numbers, overrides reach every field, bad input is clear."""

from __future__ import annotations

from pathlib import Path

import pytest

from retool.config import Config, ConfigError, dump_config, load_config, preset_names


def test_presets_exist() -> None:
    assert {"chapter", "tiny"} <= set(preset_names())


def test_chapter_preset_has_the_reference_run() -> None:
    c = load_config("chapter")
    assert c.model.name == "Qwen/Qwen3.5-4B" and c.backend.kind == "pytrio"
    assert (c.rollout.questions_per_step, c.rollout.group_size) == (8, 8)
    r = c.rollout
    assert (
        r.max_code_calls,
        r.max_assistant_turns,
        r.max_tokens_per_turn,
        r.max_observation_tokens,
        r.max_trajectory_tokens,
    ) == (4, 6, 1024, 512, 8192)
    assert c.optimizer.lr == 4e-5 and (c.optimizer.beta1, c.optimizer.beta2) == (0.9, 0.95)
    assert (c.loss.name, c.loss.clip_low, c.loss.clip_high) == ("ppo", 0.8, 1.28)
    assert c.lora.enabled and c.lora.rank == 32
    assert c.train.steps == 200 and c.checkpoint.every == 50


def test_tiny_preset_is_a_small_local_cpu_run() -> None:
    c = load_config("tiny")
    assert c.backend.kind == "local" and c.backend.device == "cpu"
    assert c.data.source == "synthetic"
    assert c.rollout.questions_per_step * c.rollout.group_size <= 16
    assert c.rollout.max_trajectory_tokens <= c.model.max_context


def test_overrides_parse_toml_values_and_reach_nested_fields() -> None:
    c = load_config(
        "tiny",
        [
            "rollout.group_size=4",
            "optimizer.lr=1e-4",
            "lora.enabled=false",
            "sandbox.preimport=['math']",
            "model.name=/some/path",
            "data.options.count=10",
        ],
    )
    assert c.rollout.group_size == 4 and c.optimizer.lr == 1e-4 and not c.lora.enabled
    assert c.sandbox.preimport == ["math"] and c.model.name == "/some/path" and c.data.options["count"] == 10


def test_dump_round_trips(tmp_path: Path) -> None:
    c = load_config(
        "chapter", ["rollout.group_size=3", "train.run_dir=runs/x y", "data.options.kinds=['mul_big']"]
    )
    path = tmp_path / "run.toml"
    path.write_text(dump_config(c))
    again = load_config(path)
    assert again == c and isinstance(again, Config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.group_size=many"], "rollout.group_size"),
        (["rollout.no_such_knob=1"], "no_such_knob"),
        (["novalue"], "section.key=value"),
        (["sft.steps=0"], "sft.steps"),
    ],
)
def test_bad_overrides_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="chapter"):
        load_config("no-such-preset")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_steps_off_policy=1", "backend.engine='vllm'"], "the vllm sampler holds one set"),
        (
            ["train.max_steps_off_policy=1", "backend.engine='llamacpp'"],
            "the llamacpp sampler holds one set",
        ),
        (["loss.tis_cap=2.0", "backend.kind='tinker'"], "loss.tis_cap needs the loss computed locally"),
    ],
)
def test_settings_that_do_not_go_together_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)
    # Each setting alone is fine.
    for item in overrides:
        load_config("tiny", [item])


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ('backend.engine="llamacpp"', "backend.engine = 'llamacpp'"),
        ('backend.engine="vllm"', "backend.engine = 'vllm'"),
        ('backend.kind="tinker"', "backend.kind = 'tinker'"),
        ('backend.kind="pytrio"', "backend.kind = 'pytrio'"),
    ],
)
def test_stop_at_boxed_is_refused_where_the_engine_would_ignore_it(setting: str, named: str) -> None:
    with pytest.raises(ConfigError, match="stop_at_boxed") as err:
        load_config(None, [setting, "sampling.stop_at_boxed=true"])
    assert named in str(err.value) and "\n" not in str(err.value)
    load_config(None, [setting])  # the engine itself is fine
    assert load_config(None, ["sampling.stop_at_boxed=true"]).sampling.stop_at_boxed  # the local sampler


def test_two_presets_of_one_name_are_refused_not_shadowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Presets are one flat namespace over retool/presets/ and every recipe folder: a recipe's preset named
    like another file would otherwise win or lose by folder order, silently."""
    import retool.config as config_module

    for folder in ("presets", "recipes/a", "recipes/b"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "presets" / "tiny.toml").write_text("")
    (tmp_path / "recipes" / "a" / "demo-a.toml").write_text("")
    monkeypatch.setattr(config_module.resources, "files", lambda package: tmp_path)
    assert config_module.preset_names() == ["demo-a", "tiny"]
    (tmp_path / "recipes" / "b" / "tiny.toml").write_text("")
    with pytest.raises(ConfigError, match="two presets named 'tiny'"):
        config_module.preset_names()
