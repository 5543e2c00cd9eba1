"""An evaluation script written the chapter's way against the PyTRIO SDK; runs unmodified on ``retool serve``.

    PYTRIO_BASE_URL=http://127.0.0.1:8000 PYTRIO_API_KEY=local python pytrio_eval.py MODEL SAMPLER_PATH OUT_JSON

Loads saved sampler weights with ``create_sampling_client(model_path=...)``, samples greedily, and writes
the tokens, their logprobs and the texts to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import pytrio
from pytrio import types


def main(model: str, sampler_path: str, out: str) -> None:
    service_client = pytrio.ServiceClient()
    sampling_client = service_client.create_sampling_client(base_model=model, model_path=sampler_path)
    training_client = service_client.create_lora_training_client(base_model=model, rank=8)
    tokenizer = training_client.get_tokenizer()
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=["\n"])
    rows = []
    for question in ("1 + 1 =", "2 + 3 ="):
        prompt = types.ModelInput.from_ints(tokenizer.encode(question))
        result = sampling_client.sample(prompt, num_samples=2, sampling_params=params).result()
        rows += [
            {"tokens": s.tokens, "logprobs": list(s.logprobs), "text": s.text, "stop_reason": s.stop_reason}
            for s in result.sequences
        ]
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
