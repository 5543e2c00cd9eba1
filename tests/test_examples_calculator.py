"""The environment seam holds: ``examples/calculator_env.py`` (a sympy calculator instead of the Python
sandbox) is trained for a few steps by the unchanged trainer and evaluated by the unchanged evaluator.

Training runs the real tiny local backend (forward, backward, optimizer); only the policy's text is
scripted (a randomly initialised model never calls a tool): even branches call the calculator and answer
with what it returned, odd branches guess. So the tool decides the rewards, and every group is mixed.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.types import Sample, SamplingParams
from retool.components import Components
from retool.config import Config, ConfigError, load_config
from retool.data.problem import Problem
from retool.data.synthetic import parse_source
from retool.env import ProblemList
from retool.protocol import ChatProtocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from calculator_env import CalculatorSource, SympyCalculator, calculate

PROBLEMS = [
    Problem(f"m{i}", f"What is {1234 + 97 * i} * {5678 + 31 * i}?", str((1234 + 97 * i) * (5678 + 31 * i)))
    for i in range(6)
]


def test_the_calculator_is_exact_and_executes_nothing() -> None:
    assert calculate("print(1234 * 5678)") == "7006652"
    assert calculate("a = 2\nb = a ** 10\nb / 3") == "1024/3"
    assert calculate("sqrt(8)") == "2*sqrt(2)"
    result = asyncio.run(SympyCalculator().arun("__import__('os').system('echo hi')"))
    assert not result.ok and "not arithmetic" in result.stderr
    for bad, why in (("open('x')", "not arithmetic"), ("x + 1", "not defined"), ("2 ** 100000", "too large")):
        result = asyncio.run(SympyCalculator().arun(bad))
        assert not result.ok and why in result.stderr, bad
    assert SympyCalculator().format_tool_content(result).startswith("Error: ")


class CalculatingPolicy:
    """Scripted text: first turn, even branches call the calculator, odd ones guess; after an observation,
    the answer is the number the calculator showed."""

    def __init__(self, protocol: ChatProtocol) -> None:
        self.protocol = protocol
        self.end = protocol.stop_token_ids[0]
        self.asked: list[str] = []

    def _text(self, prompt: str, branch: int) -> str:
        if "Let me compute." not in prompt:  # the first turn of the group
            a, b = re.findall(r"What is (\d+) \* (\d+)\?", prompt)[-1]
            if branch % 2 == 1:
                return "I guess \\boxed{42}."
            self.asked.append(f"{a} * {b}")
            return "Let me compute.\n" + self.protocol.fmt.render_call(f"print({a} * {b})")
        after_call = prompt[prompt.rfind("Let me compute.") :]
        seen = re.findall(r"-?\d+", after_call[after_call.find("print(") :].split(")", 1)[1])[0]
        return f"The calculator says \\boxed{{{seen}}}."

    async def sample_async(
        self, prompt_tokens: list[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        prompt = self.protocol.decode(prompt_tokens)
        out = []
        for b in range(num_samples):
            ids = [*self.protocol.encode(self._text(prompt, b)), self.end][: params.max_tokens]
            out.append(Sample(tokens=ids, logprobs=[-1.0] * len(ids), stop_reason="stop"))
        return out


class ScriptedSampling:
    """The real training client, with the scripted policy as its sampler."""

    def __init__(self, inner: Any, policy: CalculatingPolicy) -> None:
        self._inner, self.policy = inner, policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def sampling_client_async(self) -> CalculatingPolicy:
        return self.policy


def tiny_config(model_dir: Path, run_dir: Path) -> Config:
    return load_config(
        "tiny",
        [
            f"model.name='{model_dir}'",
            f"train.run_dir='{run_dir}'",
            "train.steps=3",
            "checkpoint.every=0",
            "rollout.questions_per_step=2",
            "rollout.group_size=4",
            "rollout.max_tokens_per_turn=64",
            "rollout.max_trajectory_tokens=1400",
            "model.max_context=2048",
            "backend.micro_batch_tokens=2048",
            "reward.verify_workers=1",
            "logging.tracker='none'",
            "logging.progress=false",
            "logging.trajectory_groups_per_step='all'",
        ],
    )


@pytest.mark.slow
def test_the_calculator_env_trains_and_evaluates_with_the_stock_trainer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from retool.backends import make_training_client
    from retool.evaluate import run_eval
    from retool.reward import Verifier
    from retool.train.loop import Trainer

    cfg = tiny_config(tiny_model_dir, tmp_path / "run")
    backend = make_training_client(cfg)
    protocol = ChatProtocol.from_config(backend.tokenizer, cfg, use_tools=True)
    policy = CalculatingPolicy(protocol)
    verifier = Verifier.from_config(cfg.reward)
    # No executor at all: the environment brings its own tool.
    parts = Components(backend=ScriptedSampling(backend, policy), protocol=protocol, verifier=verifier)
    source = CalculatorSource(ProblemList(PROBLEMS, shuffle=False))
    try:
        Trainer(cfg, tmp_path / "run", source=source, components=parts).run()
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x]
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:
            # Even branches asked the calculator and were right; odd ones guessed and were wrong.
            assert r["rewards"] == [[1.0, -1.0, 1.0, -1.0]] * 2
            assert r["train/optimizer_stepped"] and r["env/exec_calls"] == 4.0
        records = [
            json.loads(x)
            for x in (tmp_path / "run" / "trajectories.jsonl").read_text(encoding="utf-8").split("\n")
            if x
        ]
        called = [rec for rec in records if rec["code_calls"]]
        assert len(called) == 12 and len(policy.asked) == 12
        for rec in called:
            product = int(rec["reference"])
            assert rec["turns"][0]["exec"]["stdout"] == f"{product}\n" and rec["correct"]
            assert rec["turns"][0]["observation"].strip() == str(product)
        asyncio.run(parts.refresh_sampler())
        summary = asyncio.run(
            run_eval(
                PROBLEMS[:2],
                parts,
                config=cfg,
                mode="retool",
                output=tmp_path / "ev.jsonl",
                val_n=2,
                source=source,
            )
        )
        assert summary["metrics"]["average_at_n"] == 0.5  # branch 0 calculates, branch 1 guesses
    finally:
        verifier.close()
        backend.close()


@pytest.mark.slow
def test_the_calculator_recipe_runs_through_the_unchanged_demo_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``examples/calculator_recipe.py`` (``docs/recipes.md``'s worked example): registered by name, run by
    ``run_demo``, its cold start's observations the calculator's, its tasks only the kinds its own option
    ``kinds`` names (``--set``), recorded under ``options`` in ``settings.json``."""
    from calculator_recipe import ARITHMETIC_KINDS, RECIPE, CalculatorOptions, calculator_settings

    from retool.recipes import RECIPES, recipe_named
    from retool.recipes.demo import run_demo
    from retool.recipes.tiny import RECIPE as TINY

    calls: list[str] = []
    real_arun = SympyCalculator.arun

    async def counted(self: SympyCalculator, code: str) -> Any:
        calls.append(code)
        return await real_arun(self, code)

    monkeypatch.setattr(SympyCalculator, "arun", counted)
    assert RECIPES["calculator"] is RECIPE and recipe_named("calculator") is RECIPE
    options = calculator_settings("x").options
    assert isinstance(options, CalculatorOptions) and options.kinds == ARITHMETIC_KINDS
    assert options == CalculatorOptions(**{**TINY.options.as_dict(), "kinds": ARITHMETIC_KINDS})
    assert options.hard_tool == 0.8  # the tiny recipe's TOML's [recipe] table
    with pytest.raises(
        ConfigError, match=r"CalculatorOptions \(test_hard_fraction, gsm8k_problems, hard_tool, .*, kinds\)"
    ):
        calculator_settings("x", ["kind=['add_small']"])
    shrunk = [
        "data.options.count=24",
        "data.options.test_count=6",
        "sft.steps=2",
        "sft.batch_size=4",
        "eval.val_n=1",
        "train.steps=1",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "filters.max_extra_rounds=1",
        "pipeline.size=test",
        "pipeline.plots=false",
        "recipe.kinds=['add_small', 'mul_small', 'mul_big']",  # the recipe's own option
    ]
    out = tmp_path / "calculator"
    result = run_demo(calculator_settings(str(out), shrunk))
    assert {row["model"] for row in result.table} == {"sft", "rl"}
    saved = json.loads((out / "settings.json").read_text())
    assert saved["recipe"] == "calculator"
    assert saved["options"]["kinds"] == ["add_small", "mul_small", "mul_big"]
    train = [json.loads(line) for line in (out / "tasks" / "train.jsonl").read_text().splitlines()]
    kinds = {parse_source(t["data_source"]) for t in train}
    assert train and {kind for kind, _hard in kinds if kind} <= {"add_small", "mul_small", "mul_big"}
    # The cold start's observations are the calculator's output for the train tasks' canonical code.
    settings = calculator_settings(str(out), shrunk)
    family = RECIPE.source(settings, settings.config).inner
    assert {t.id for t in family.tasks("train")} == {t["id"] for t in train}
    assert {t.code for t in family.tasks("train")} & set(calls)
