"""Plain data types shared by every backend: what a sampler returns and what a trainer consumes.

Shaped after the Tinker / PyTRIO SDK types so that adapters are thin. Token alignment follows the
usual convention: for a token sequence ``seq``, ``input_tokens = seq[:-1]`` and
``target_tokens = seq[1:]``; ``logprobs[i]``, ``advantages[i]`` and ``weights[i]`` belong to
``target_tokens[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

StopReason = Literal["stop", "length"]
LossName = Literal["ppo", "importance_sampling", "cross_entropy", "cispo", "dro", "gspo", "stable_reinforce"]


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the backends call themselves (the rest is the protocol's)."""

    def encode(self, text: str, /) -> list[int]: ...


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. ``stop`` holds strings or token ids (not mixed). ``stop_at_boxed``:
    end the completion as soon as it holds a closed ``\\boxed{...}`` (greedy evaluation, where nothing after
    the first answer is read). Only the local engine's own sampler does it; the config refuses it elsewhere."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | tuple[int, ...] = ()
    stop_at_boxed: bool = False


@dataclass
class Sample:
    """One sampled completion.

    ``tokens`` are exactly the tokens the sampler emitted (a stop token it emitted is included);
    ``logprobs[i]`` is the model's *raw* log-probability of ``tokens[i]`` (temperature and top-p only
    shape the choice), so a trainer recomputing them on-policy sees a ratio of exactly 1.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass
class Datum:
    """One training sequence (one trajectory), already shifted by one.

    ``weights`` is the per-token loss weight: 0 masks a position out (prompt and interpreter
    observation tokens); for RL losses the trainer multiplies the per-token loss by it. The training
    loop puts its reduction factor (e.g. ``1 / n_tokens / n_datums``) into ``weights`` so that the
    accumulated gradient is the mean over trained datums on every backend.
    """

    input_tokens: list[int]
    target_tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    # gspo only: the positions its sequence ratio averages over (non-zero = in); empty: the trained ones.
    ratio_mask: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.input_tokens)
        if len(self.target_tokens) != n:
            raise ValueError(f"target_tokens has {len(self.target_tokens)} positions, input_tokens {n}")
        for name in ("logprobs", "advantages", "weights", "ratio_mask"):
            values = getattr(self, name)
            if values and len(values) != n:
                raise ValueError(f"{name} has {len(values)} positions, input_tokens {n}")

    def __len__(self) -> int:
        return len(self.input_tokens)


@dataclass(frozen=True)
class AdamParams:
    lr: float = 4e-5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # 0 turns clipping off


@dataclass
class ForwardBackwardResult:
    """Metrics of one forward_backward call (accumulated gradients, no optimizer step yet).

    The ``ratio_*`` / ``clip_fraction`` figures describe the ratio the PPO clip sees. The mismatch figures
    compare the trainer's logprob ``lp`` with the sampler's ``mu`` on the ``mismatch_tokens`` trained
    tokens of an RL loss (``retool.backends.training.losses``): mean and max ``|lp - mu|``, the k3 estimate of
    KL(sampler || trainer), the share of tokens with ``exp(lp - mu)`` outside [0.5, 2] and, with truncated
    importance sampling, the share whose weight was cut to the cap.

    Measured by the local backend only (``None`` where the backend did not): ``entropy``, the mean entropy
    of the policy's next-token distribution (over the whole vocabulary, in nats) at the trained positions;
    ``ref_kl``, the mean k3 estimate of KL(policy || reference) over them, when the loss config asked for
    the reference policy (``measure_ref_kl`` / ``ref_kl_coef``: ``retool.backends.training.losses``).
    """

    loss: float
    trained_tokens: int
    ratio_mean: float = 1.0
    ratio_min: float = 1.0
    ratio_max: float = 1.0
    clip_fraction: float = 0.0
    mismatch_tokens: int = 0
    logprob_diff_mean: float = 0.0
    logprob_diff_max: float = 0.0
    kl_k3: float = 0.0
    ratio_outside: float = 0.0
    tis_truncated: float = 0.0
    entropy: float | None = None
    ref_kl: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    # The learner's logprob of every target token, one list per datum in call order (local backend only;
    # ``retool serve`` returns them as the SDKs' ``loss_fn_outputs[i]["logprobs"]``).
    token_logprobs: list[list[float]] | None = None

    def as_metrics(self, prefix: str = "policy/") -> dict[str, float]:
        out = {
            f"{prefix}loss": self.loss,
            f"{prefix}trained_tokens": float(self.trained_tokens),
            f"{prefix}ratio_mean": self.ratio_mean,
            f"{prefix}ratio_min": self.ratio_min,
            f"{prefix}ratio_max": self.ratio_max,
            f"{prefix}clip_fraction": self.clip_fraction,
        }
        out.update({f"{prefix}{k}": v for k, v in self.extra.items()})
        return out


@dataclass(frozen=True)
class OptimStepResult:
    grad_norm: float
    lr: float


# How a managed service normalises a summed loss (``retool.backends.training.reduction`` finds out which).
ReductionMode = Literal["sum", "samples", "active_tokens", "advantage_tokens", "sequence_mean"]


@dataclass(frozen=True)
class ReductionReport:
    """What the probe found for one loss: the matched mode and the numbers it was read from."""

    loss_fn: str
    mode: ReductionMode
    denominator: int  # on the probe batch; 0 for ``sequence_mean`` (one per datum)
    local_loss: float  # NaN when identified from gradient norms
    server_loss: float  # NaN when identified from gradient norms
    detail: str = ""  # what was measured, in words
