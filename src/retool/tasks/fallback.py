"""Stand-ins used by the demo only while a stage's real module is missing from the tree.

``retool.tasks`` depends on the protocol, sandbox, reward and backend stages; during development they
land at different times. Each stand-in implements the slice of the ARCHITECTURE.md contract the demo
needs, for the tiny model's Hermes template only, and ``get_*`` helpers prefer the real module. Every
use of a stand-in is logged as a warning so a run never silently depends on one.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CODE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python code to run."}},
            "required": ["code"],
        },
    },
}
TOOL_SYSTEM_PROMPT = "Solve the problem. Use the code_interpreter tool when computation helps. Put the final answer in \\boxed{}."
TEXT_SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."


@dataclass
class ParsedAssistant:
    kind: str
    content: str
    code: str | None = None
    reason: str | None = None


_CALL_RE = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>\s*$", re.DOTALL)


class FallbackHermesProtocol:
    """Minimal ``ChatProtocol`` for the tiny model's Hermes template (stand-in, see module doc)."""

    def __init__(self, tokenizer: Any, use_tools: bool = True) -> None:
        logger.warning("retool.protocol not available: using the demo's fallback Hermes protocol")
        self.tokenizer = tokenizer
        self.use_tools = use_tools
        self.system_prompt = TOOL_SYSTEM_PROMPT if use_tools else TEXT_SYSTEM_PROMPT
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_token_ids = [end]

    def initial_messages(self, question: str) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=[CODE_TOOL] if self.use_tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def build_prompt(self, messages: list[dict]) -> list[int]:
        return self._encode(self._render(messages, True))

    def assistant_message(self, text: str) -> dict:
        return {"role": "assistant", "content": text}

    def tool_message(self, content: str) -> dict:
        return {"role": "tool", "content": content}

    def encode_completion(self, text: str, close: bool = True) -> list[int]:
        return self._encode(text) + (self.stop_token_ids[:1] if close else [])

    def build_next_prompt(
        self,
        messages_before_assistant: list[dict],
        previous_prompt_tokens: list[int],
        completion_tokens: list[int],
        tool_message: dict,
    ) -> list[int]:
        placeholder = [*messages_before_assistant, self.assistant_message("x")]
        with_assistant = self._render(placeholder, False)
        with_tool = self._render([*placeholder, tool_message], True)
        if not with_tool.startswith(with_assistant):
            raise RuntimeError("tiny chat template is not append-only")
        closing = with_assistant[with_assistant.rindex("x") + 1 :]
        close_ids = self._encode(closing)
        tokens = list(previous_prompt_tokens) + list(completion_tokens)
        if completion_tokens and close_ids and completion_tokens[-1] == close_ids[0]:
            close_ids = close_ids[1:]
        return tokens + close_ids + self._encode(with_tool[len(with_assistant) :])

    def parse(self, text: str) -> ParsedAssistant:
        if "<tool_call>" not in text:
            return ParsedAssistant("answer", text)
        if text.count("<tool_call>") != 1:
            return ParsedAssistant("invalid", text, reason="more than one call")
        match = _CALL_RE.search(text)
        if not match:
            return ParsedAssistant("invalid", text, reason="malformed call")
        try:
            call = json.loads(match.group(1))
            code = call["arguments"]["code"]
        except (ValueError, KeyError, TypeError):
            return ParsedAssistant("invalid", text, reason="bad json")
        if call.get("name") != "code_interpreter" or not isinstance(code, str) or not code.strip():
            return ParsedAssistant("invalid", text, reason="bad call")
        return ParsedAssistant("tool", text[: match.start()], code=code)

    @staticmethod
    def render_call(code: str) -> str:
        return (
            "<tool_call>\n"
            + json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
            + "\n</tool_call>"
        )


def trusted_exec(code: str) -> tuple[bool, str, float]:
    """Run TRUSTED canonical code in-process (no sandbox): SFT data generation only, never model output."""
    start = time.perf_counter()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except Exception as exc:  # the traceback tail the model would see
        return (
            False,
            f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}\n",
            time.perf_counter() - start,
        )
    return True, out.getvalue(), time.perf_counter() - start


def extract_last_boxed(text: str) -> str | None:
    """Last ``\\boxed{...}`` with brace matching (stand-in for ``retool.reward.extract_last_boxed``)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def integer_score(text: str, reference: str) -> tuple[float, bool, bool, str | None]:
    """(reward, correct, valid_format, answer) for integer references (stand-in verifier)."""
    answer = extract_last_boxed(text[-300:])
    if answer is None:
        return -1.0, False, False, None
    correct = answer.strip() == reference.strip()
    return (1.0 if correct else -1.0), correct, True, answer


class SubprocessRunner:
    """Stand-in executor: a fresh ``python -c`` per call with a timeout (no isolation beyond that)."""

    def __init__(self, timeout: float = 5.0) -> None:
        logger.warning("retool.sandbox not available: running model code in plain subprocesses (unsafe)")
        self.timeout = timeout

    def run_text(self, code: str) -> tuple[bool, str]:
        import subprocess
        import sys

        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=self.timeout
            )
        except subprocess.TimeoutExpired:
            return False, f"Error: execution timed out after {self.timeout:g} seconds."
        if proc.returncode == 0:
            return True, proc.stdout[-4096:]
        return False, (proc.stderr or f"Error: process exited with code {proc.returncode}.")[-4096:]


def make_fallback_training_client(model_path: str, seed: int = 0) -> Any:
    """Full fine-tuning torch client (stand-in for ``retool.backends.LocalTrainingClient``)."""
    logger.warning("retool.backends LocalTrainingClient not available: using the demo's torch fallback")
    return _TorchClient(model_path, seed)


def _torch_client_cls() -> Any:
    import torch

    from retool.backends.base import SamplingClient, TrainingClient
    from retool.backends.losses import token_loss
    from retool.backends.types import ForwardBackwardResult, OptimStepResult, Sample

    class TorchSampler(SamplingClient):
        def __init__(self, model: Any, pad_id: int) -> None:
            self.model = model
            self.pad_id = pad_id

        async def sample_async(self, prompt_tokens, num_samples, params):  # type: ignore[no-untyped-def]
            return self.sample_batch([list(prompt_tokens)] * num_samples, params)

        @torch.no_grad()
        def sample_batch(self, prompts: list[list[int]], params: Any) -> list[Sample]:
            if params.seed is not None:
                torch.manual_seed(params.seed)
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            stops = [int(s) for s in params.stop]
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0,
                max_new_tokens=params.max_tokens,
                eos_token_id=stops,
                pad_token_id=self.pad_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            gen = out.sequences[:, width:]
            logits = torch.stack(out.logits, dim=1).float().log_softmax(-1)
            lps = logits.gather(-1, gen.unsqueeze(-1)).squeeze(-1)
            samples = []
            for i in range(len(prompts)):
                toks, lp = [], []
                reason = "length"
                for t in range(gen.shape[1]):
                    tok = int(gen[i, t])
                    toks.append(tok)
                    lp.append(float(lps[i, t]))
                    if tok in stops:
                        reason = "stop"
                        break
                samples.append(Sample(tokens=toks, logprobs=lp, stop_reason=reason))
            return samples

    class TorchClient(TrainingClient):
        def __init__(self, model_path: str, seed: int) -> None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.manual_seed(seed)
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.model.train()
            self.opt: Any = None
            self.path = model_path

        async def forward_backward_async(self, datums, loss_fn, loss_config=None):  # type: ignore[no-untyped-def]
            self.model.train()
            width = max(len(d) for d in datums)
            n = len(datums)
            pad = self.tokenizer.pad_token_id
            inp = torch.full((n, width), pad, dtype=torch.long)
            tgt = torch.zeros((n, width), dtype=torch.long)
            w = torch.zeros((n, width))
            old = torch.zeros((n, width))
            adv = torch.zeros((n, width))
            mask = torch.zeros((n, width), dtype=torch.long)
            for i, d in enumerate(datums):
                k = len(d)
                inp[i, :k] = torch.tensor(d.input_tokens)
                tgt[i, :k] = torch.tensor(d.target_tokens)
                mask[i, :k] = 1
                if d.weights:
                    w[i, :k] = torch.tensor(d.weights)
                if d.logprobs:
                    old[i, :k] = torch.tensor(d.logprobs)
                if d.advantages:
                    adv[i, :k] = torch.tensor(d.advantages)
            logits = self.model(input_ids=inp, attention_mask=mask).logits.float()
            lp = logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            tl = token_loss(loss_fn, lp, w, old, adv, loss_config)
            loss = tl.loss.sum()
            loss.backward()
            return ForwardBackwardResult(loss=float(loss), trained_tokens=int(tl.trained.sum()))

        async def optim_step_async(self, adam):  # type: ignore[no-untyped-def]
            if self.opt is None:
                self.opt = torch.optim.AdamW(
                    self.model.parameters(),
                    lr=adam.lr,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            for g in self.opt.param_groups:
                g["lr"] = adam.lr
                g["betas"] = (adam.beta1, adam.beta2)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), adam.grad_clip_norm or 1e9)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return OptimStepResult(grad_norm=float(norm), lr=adam.lr)

        async def save_state_async(self, name):  # type: ignore[no-untyped-def]
            self.model.save_pretrained(name)
            self.tokenizer.save_pretrained(name)
            return name

        async def load_state_async(self, path):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        async def sampling_client_async(self):  # type: ignore[no-untyped-def]
            self.model.eval()
            return TorchSampler(self.model, self.tokenizer.pad_token_id)

    return TorchClient


def _TorchClient(model_path: str, seed: int) -> Any:
    return _torch_client_cls()(model_path, seed)
