"""retool.recipes: every task the demo runs, one folder each, registered by name (``retool recipes``).

A recipe (``retool.pipeline.recipe.Recipe``) owns its preset (a TOML file in its folder, found by name as
any preset is), its problem source, its held-out set, its cold start and a README (what it teaches, the
one command, the one number it reaches, its cost here). The pipeline that runs it,
``retool.pipeline.run``, knows no task by name; ``retool.recipes.demo`` joins the two
(``run_demo``, ``run_sft``).

- ``tiny``: the embedded default, a tiny model built here on the synthetic task family;
- ``smollm2``: the same tasks on SmolLM2-135M-Instruct;
- ``gsm8k``: GSM8K with SmolLM2, cold start from annotated solutions;
- ``mathematics``: DeepMind Mathematics with SmolLM2, cold start from its own verified attempts.

Adding a recipe is a folder (its options, a ``RecipeOptions`` subclass, included) and one line in
``RECIPES`` (or ``register_recipe`` from one's own module: ``docs/recipes.md``); no other file changes.
"""

from __future__ import annotations

from retool.errors import UserError
from retool.pipeline.recipe import Recipe
from retool.recipes import gsm8k, mathematics, smollm2, tiny

RECIPES: dict[str, Recipe] = {
    r.name: r for r in (tiny.RECIPE, smollm2.RECIPE, gsm8k.RECIPE, mathematics.RECIPE)
}


class UnknownRecipeError(UserError, ValueError):
    """No recipe of that name (or for that model and task); the message lists the known ones."""


def register_recipe(recipe: Recipe) -> Recipe:
    """Make ``recipe`` known by its name (``retool demo --recipe NAME``, ``retool recipes``)."""
    RECIPES[recipe.name] = recipe
    return recipe


def recipe_named(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownRecipeError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}") from None


def recipe_for(model: str, task: str = tiny.TASK) -> Recipe:
    """The recipe that runs ``task`` on the model named ``model`` (``smollm2`` + ``gsm8k``: ``gsm8k``)."""
    for recipe in RECIPES.values():
        if (recipe.model, recipe.task) == (model, task):
            return recipe
    runs = [r.task for r in RECIPES.values() if r.model == model]
    if not runs:
        known = ", ".join(dict.fromkeys(r.model for r in RECIPES.values()))
        raise UnknownRecipeError(f"--model {model!r}: known: {known}")
    raise UnknownRecipeError(f"--task {task!r}: {model} runs {', '.join(runs)}")
