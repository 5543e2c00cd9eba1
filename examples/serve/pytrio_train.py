"""A training script written the chapter's way against the PyTRIO SDK; runs unmodified on ``retool serve``.

    PYTRIO_BASE_URL=http://127.0.0.1:8000 PYTRIO_API_KEY=local python pytrio_train.py MODEL STEPS OUT_JSON

Each step: sampler from the current weights, a group of samples per prompt, a made-up reward (the share of
even token ids, so the script needs no data), group-centred advantages, one PPO ``forward_backward`` and one
``optim_step``; then ``save_state`` and ``save_weights_for_sampler``. Writes what it saw to OUT_JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytrio
from pytrio import types


def reward(tokens: list[int]) -> float:
    return sum(1 for t in tokens if t % 2 == 0) / max(len(tokens), 1)


async def step(training_client: pytrio.TrainingClient, prompts: list[list[int]], group: int) -> dict:
    sampling_client = training_client.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    results = await asyncio.gather(
        *[
            sampling_client.sample_async(
                types.ModelInput.from_ints(p), num_samples=group, sampling_params=params
            )
            for p in prompts
        ]
    )
    data, rewards = [], []
    for prompt, result in zip(prompts, results, strict=True):
        scores = [reward(s.tokens) for s in result.sequences]
        mean = sum(scores) / len(scores)
        rewards += scores
        for seq, score in zip(result.sequences, scores, strict=True):
            tokens = prompt + seq.tokens
            n = len(tokens) - 1
            first = len(prompt) - 1  # targets from here on are sampled tokens
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                        "logprobs": types.TensorData.from_numpy(
                            np.asarray([0.0] * first + list(seq.logprobs), dtype=np.float32)
                        ),
                        "advantages": types.TensorData.from_numpy(
                            np.asarray([0.0] * first + [score - mean] * (n - first), dtype=np.float32)
                        ),
                    },
                )
            )
    fb = training_client.forward_backward(
        data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    ).result()
    opt = training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return {"reward": sum(rewards) / len(rewards), "loss": fb.metrics["loss_sum"], "opt": opt.metrics}


def main(model: str, steps: int, out: str) -> None:
    service_client = pytrio.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=model, rank=8, seed=3)
    tokenizer = training_client.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in ("1 + 1 =", "2 + 3 =")]
    history = [asyncio.run(step(training_client, prompts, group=4)) for _ in range(steps)]
    state = training_client.save_state("final").result()
    weights = training_client.save_weights_for_sampler("final-sampler").result()
    with open(out, "w") as f:
        json.dump({"history": history, "state_path": state.path, "sampler_path": weights.path}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
