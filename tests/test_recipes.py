"""The recipe registry: every recipe is a folder with its preset, README and ``RECIPE``; a model and task
pair names one; the demo-only fields a recipe sets are ``DemoSettings``'."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest

from retool.config import ConfigError, load_config, preset_names
from retool.pipeline.settings import DemoFields, DemoSettings
from retool.recipes import RECIPES, UnknownRecipeError, recipe_for, recipe_named
from retool.recipes.demo import recipe_settings

RECIPES_DIR = Path(__file__).resolve().parents[1] / "src" / "retool" / "recipes"


def test_every_shipped_recipe_is_a_folder_with_its_preset_and_readme() -> None:
    folders = sorted(p.name for p in RECIPES_DIR.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(["tiny", "smollm2", "gsm8k", "mathematics"])
    assert set(folders) <= set(RECIPES)
    for name in folders:
        recipe = RECIPES[name]
        assert (RECIPES_DIR / name / f"{recipe.preset}.toml").is_file(), name
        assert recipe.preset in preset_names() and load_config(recipe.preset).model.name == recipe.model
        readme = (RECIPES_DIR / name / "README.md").read_text()
        assert f"Recipe `{name}`" in readme and "retool demo" in readme, name


def test_model_and_task_pairs_name_the_recipes() -> None:
    pairs = {
        ("tiny", "synthetic"): "tiny",
        ("smollm2", "synthetic"): "smollm2",
        ("smollm2", "gsm8k"): "gsm8k",
        ("smollm2", "mathematics"): "mathematics",
    }
    assert {pair: recipe_for(*pair).name for pair in pairs} == pairs
    with pytest.raises(UnknownRecipeError, match="known: tiny, smollm2"):
        recipe_for("gpt-17")
    with pytest.raises(UnknownRecipeError, match="smollm2 runs synthetic, gsm8k, mathematics"):
        recipe_for("smollm2", "mnist")
    with pytest.raises(UnknownRecipeError, match="known: tiny, smollm2, gsm8k, mathematics"):
        recipe_named("nope")


def test_a_recipe_sets_only_demo_fields_and_its_settings_carry_them() -> None:
    demo_only = {f.name for f in dataclasses.fields(DemoSettings)} - {"config"}
    assert set(DemoFields.__annotations__) == demo_only  # the keyword form names every field, no other
    for recipe in RECIPES.values():
        assert set(recipe.fields) <= demo_only - {"options"}, recipe.name  # its options: ``options``
        # Its options' names are its own: none is a generic field a --set of that name would mean.
        assert not set(recipe.options_type.names()) & demo_only, recipe.name
        if recipe.model == "tiny":
            continue
        settings = recipe_settings(recipe.name)
        assert settings.recipe == recipe.name and settings.options == recipe.options, recipe.name
        assert all(getattr(settings, k) == v for k, v in recipe.fields.items()), recipe.name


def test_a_recipe_declares_its_own_options_and_settings_json_records_them() -> None:
    gsm8k = recipe_settings("gsm8k", ["recipe.coldstart_rows=5"])
    assert gsm8k.options == replace(RECIPES["gsm8k"].options, coldstart_rows=5)
    assert gsm8k.as_dict()["options"] == {
        "gsm8k_problems": 100,
        "coldstart_rows": 5,
        "rl_max_solution_steps": 3,
        "coldstart_steps_per_call": 1,
        "coldstart_text_only_share": 0.2,
    }
    with pytest.raises(
        ConfigError, match=r"Gsm8kOptions \(gsm8k_problems, coldstart_rows, rl_max_solution_steps, "
    ):
        recipe_settings("gsm8k", ["recipe.mathematics_problems=1"])
    # settings built without a recipe read as the recipe's options type's defaults
    plain = DemoSettings.load(["pipeline.recipe=gsm8k"])
    assert recipe_named(plain.recipe).own_options(plain).options == type(RECIPES["gsm8k"].options)()


def test_demo_set_names_a_recipe_option_or_lists_them(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from retool.cli import app

    result = CliRunner().invoke(app, ["demo", "--recipe", "gsm8k", "--set", "nope=1", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "recipe gsm8k" in result.output and "coldstart_rows" in result.output
    # --gsm8k is the synthetic (and GSM8K) recipes' option gsm8k_problems: the mathematics recipe has none
    result = CliRunner().invoke(
        app, ["demo", "--recipe", "mathematics", "--gsm8k", "3", "--out", str(tmp_path)]
    )
    assert (
        result.exit_code != 0
        and "gsm8k_problems" in result.output
        and "mathematics_problems" in result.output
    )


def test_retool_recipes_lists_them_and_demo_takes_a_recipe(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from retool.cli import app

    listed = CliRunner().invoke(app, ["recipes"])
    assert listed.exit_code == 0
    lines = listed.output.splitlines()
    assert lines[0].split()[:3] == ["recipe", "model", "task"]
    assert [line.split()[0] for line in lines[1:5]] == list(RECIPES)[:4]
    assert "retool demo --recipe NAME" in listed.output
    result = CliRunner().invoke(app, ["demo", "--recipe", "nope", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "unknown recipe 'nope'" in result.output
    for retired in ("--model", "--task"):  # --recipe names the model and the task
        refused = CliRunner().invoke(app, ["demo", retired, "smollm2", "--out", str(tmp_path / "r")])
        assert refused.exit_code == 2 and f"No such option: {retired}" in refused.output
    assert not (tmp_path / "r").exists()


def test_a_recipe_is_one_toml_its_tables_validated_by_the_settings_and_options_classes(
    tmp_path: Path,
) -> None:
    """Each shipped recipe reads its demo-only fields and options from its preset's [pipeline] and [recipe]
    tables; a name neither class declares is refused in one line, and the config never sees the tables."""
    from retool.pipeline.recipe import from_preset
    from retool.recipes.gsm8k import Gsm8kOptions

    gsm8k = RECIPES["gsm8k"]
    assert from_preset(gsm8k.preset, Gsm8kOptions) == {"fields": gsm8k.fields, "options": gsm8k.options}
    assert gsm8k.options == Gsm8kOptions(
        gsm8k_problems=100, coldstart_rows=800, rl_max_solution_steps=3, coldstart_text_only_share=0.2
    )
    assert gsm8k.fields["eval_modes"] == ("text-only", "retool")  # TOML arrays read as the settings' tuples
    load_config(gsm8k.preset)  # [pipeline] and [recipe] are not config sections
    bad = tmp_path / "bad.toml"
    bad.write_text('[pipeline]\nsize = "test"\n[recipe]\ncoldstart_rows = 3\nnope = 1\n')
    with pytest.raises(ConfigError, match=r"\[recipe\]: no option nope in Gsm8kOptions"):
        from_preset(str(bad), Gsm8kOptions)
    bad.write_text("[pipeline]\nwhatever = 1\n")
    with pytest.raises(ConfigError, match=r"\[pipeline\] whatever: not demo fields"):
        from_preset(str(bad), Gsm8kOptions)


def test_settings_built_without_the_tiny_recipe_run_as_it_does() -> None:
    """The synthetic options' defaults are the tiny recipe's TOML values: ``DemoSettings()`` (no recipe named)
    then cold-starts with the same styles as ``retool demo``."""
    from retool.recipes.tiny import SyntheticOptions

    assert RECIPES["tiny"].options == SyntheticOptions()


def test_a_config_files_recipe_table_tunes_the_recipe_and_set_wins(tmp_path: Path) -> None:
    from retool.recipes.tiny import SyntheticOptions

    mine = tmp_path / "mine.toml"
    mine.write_text("[train]\nsteps = 3\n[recipe]\nhard_tool = 0.5\n")
    settings = DemoSettings.load([], config=mine, options=SyntheticOptions())
    assert settings.options.hard_tool == 0.5 and settings.config.train.steps == 3  # type: ignore[attr-defined]
    again = DemoSettings.load(["recipe.hard_tool=0.6"], config=mine, options=SyntheticOptions())
    assert again.options.hard_tool == 0.6  # type: ignore[attr-defined]
    mine.write_text("[recipe]\nnope = 1\n")
    with pytest.raises(ConfigError, match=r"mine\.toml: \[recipe\]: no option nope in SyntheticOptions"):
        DemoSettings.load([], config=mine, options=SyntheticOptions())
