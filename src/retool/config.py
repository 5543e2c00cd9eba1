"""The one typed configuration of a run: every knob a user sets, loadable from TOML, overridable from the CLI.

``load_config(path, overrides)`` reads a TOML file (or a named preset: ``retool/presets/<name>.toml``, or
one in a recipe's folder, ``retool/recipes/<recipe>/<name>.toml``) and applies ``section.key=value``
overrides (values parsed as TOML literals, falling back to strings);
``override_config`` applies overrides to a loaded config.

This is the one source of defaults: every command's defaults are these (or a preset's), and its flags
become overrides only when given (``flag_overrides``), so a flag never silently replaces a config value.

Long because it is every section a user sets, each field with the comment that says why its default,
and the checks that span sections (``Config._check_combinations``); split by section, a reader would
look for a knob in a dozen files instead of one.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from retool.errors import UserError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    # A local HF folder, a Hub id, a .gguf file, or "tiny": the tiny local model, built on first use into
    # <train.run_dir>/tiny_model (``retool.backends.resolve_model_name``).
    name: str = "tiny"
    gguf_file: str | None = None  # a GGUF file name inside `name` when `name` is a folder
    tool_format: Literal["auto", "qwen_xml", "hermes", "markdown"] = "auto"
    enable_thinking: bool | None = None  # passed to templates that read it (Qwen3/3.5); None = their default
    chat_template: str | None = None  # overrides the tokenizer's template: .jinja path or template text
    # Wording of the system prompt: the chapter's ("full") or the same rules in ~1/3 of the tokens
    # ("compact": small models, short contexts, CPU runs where every prompt token is trained again).
    system_prompt: Literal["full", "compact"] = "full"
    max_context: int = 8192


class BackendConfig(_Section):
    kind: Literal["local", "pytrio", "tinker"] = "local"
    device: str = "auto"  # auto | cpu | cuda
    # The local backend's compute dtype (retool.backends.local.precision). bfloat16: bf16 matmuls over fp32
    # master weights and optimizer state, sampling in bf16. auto: bfloat16 on a GPU that has it and on a
    # CPU with native bf16 (avx512_bf16 / amx_bf16) for a model wide enough to gain from it; else float32,
    # the reason in the log.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # The engine the local backend samples with. hf: the built-in torch one; vllm: vLLM (GPU, or its CPU build); llamacpp: llama.cpp (xllamacpp) from the
    # GGUF file plus the trainer's LoRA as an adapter GGUF (GGUF models with LoRA; retool.backends.samplers.llamacpp)
    engine: Literal["hf", "vllm", "llamacpp"] = "hf"
    llamacpp_threads: int = 2  # llama.cpp's CPU threads (engine = "llamacpp")
    # The vLLM sampler (engine = "vllm", retool.backends.samplers.vllm). Its dtype: "trainer" computes in the
    # trainer's own dtype, so sampled logprobs are the trainer's (vLLM's own "auto" would downcast an fp32
    # model to bf16); another dtype (bf16 serving beside an fp32 master copy) is allowed, with a warning,
    # and its mismatch shows in every step's offpolicy/kl_k3, offpolicy/ratio_outside and TIS metrics.
    vllm_dtype: Literal["trainer", "float32", "bfloat16", "float16"] = "trainer"
    # Its memory: on CPU the KV cache in GiB (vLLM's share-of-memory setting is a share of host RAM there);
    # on a GPU the share of device memory the engine may take (weights, activations and KV cache).
    vllm_kv_cache_gib: float = Field(default=1.0, gt=0.0)
    vllm_gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    base_url: str | None = None  # remote services; credentials come from their usual env variables
    micro_batch_tokens: int = 8192  # padded area (rows x longest row) of one micro-batch
    # The fixed cost of one micro-batch's forward and backward, in padded tokens: > 0 packs micro-batches
    # by least padded area plus this much per micro-batch (tighter batches where padding costs more);
    # 0 packs the fewest micro-batches (retool.backends.training.packing).
    micro_batch_overhead: int = Field(default=0, ge=0)
    sample_batch_size: int = 32  # sequences generated together by the local sampler
    # torch CPU threads of the local backend (0: torch's default; 1 is fastest on a busy CPU)
    cpu_threads: int = 0
    # Processes the local backend trains in (CPU, data parallel: each runs a share of every batch on the
    # same shared weights; retool.backends.local.data_parallel). 1: this process only; 0: one per available core.
    processes: int = Field(default=1, ge=0)
    # With processes > 1, the live sampler generates on every process (each on its core, the same shared
    # weights; retool.backends.local.replica_sampling); false: on this process alone.
    sample_on_replicas: bool = True
    # The prefix every row of a training micro-batch shares (the system prompt; within a group the question)
    # runs once, forward and backward (retool.backends.local.shared_prefix); false: once per row.
    share_train_prefix: bool = True
    # Memory cap (MiB) of the local sampler's prefix cache: KV of sequences already run, reused by any
    # request that extends them (a trajectory's next turn, a group's prompt); LRU; 0 turns it off.
    prefix_cache_mb: float = Field(default=1024.0, ge=0.0)
    # Allocations of at least this many MiB get their own mapping, returned to the OS when freed (glibc's
    # malloc otherwise keeps freed activations resident: ``retool.backends.heap``); 0: glibc's default.
    mmap_threshold_mb: float = Field(default=1.0, ge=0.0)


class LoraConfig(_Section):
    enabled: bool = True
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class PassRateConfig(_Section):
    """``data.selection = "pass_rate"``: how problems are drawn by their estimated pass rates
    (``retool.train.selection``; docs/training.md, "Sampling where the gradient is")."""

    # A problem is drawn while its estimated pass rate lies in [band_low, band_high]; outside it is retired
    # (hopeless below, solved above) and gets only the ``explore`` share of draws.
    band_low: float = Field(default=0.05, ge=0.0, le=1.0)
    band_high: float = Field(default=0.95, ge=0.0, le=1.0)
    explore: float = Field(default=0.1, ge=0.0, le=1.0)
    # Smoothing: the prior's weight in attempts (a problem's prior is its category's rate, a category's 0.5),
    # and how many recent attempts a problem's / a category's estimate follows (older ones fade).
    prior_attempts: float = Field(default=4.0, gt=0.0)
    problem_window: float = Field(default=64.0, gt=0.0)
    category_window: float = Field(default=256.0, gt=0.0)
    # A problem estimated below ``rare_below`` gets a group of ``group_size_rare`` attempts (0: off; only
    # a size above rollout.group_size has an effect), so a rare success has a chance to show up.
    group_size_rare: int = Field(default=0, ge=0)
    rare_below: float = Field(default=0.15, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_band(self) -> PassRateConfig:
        if self.band_low > self.band_high:
            raise ValueError(f"band_low = {self.band_low} is above band_high = {self.band_high}")
        return self


class DataConfig(_Section):
    """Where problems come from: an environment (``retool.env``) named by ``source``; in which order
    training draws them (``selection``: the source's epochs, or by estimated pass rate)."""

    # A registered environment (tasks, dapo, aime2025, aime2024, math500), a JSONL / JSON / parquet file
    # (e.g. the train.jsonl `retool prepare` writes), a folder `retool prepare dapo` wrote, or a Hub id.
    source: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    shuffle: bool = True
    seed: int = 0
    data_dir: str | None = (
        None  # where named sets are looked for first (<name>.jsonl); else $RETOOL_DATA_DIR, else the user cache
    )
    # The own options of the source ``source`` names (``[data.options]``), validated by that source when
    # it is built (``retool.env.register_source``): e.g. the synthetic family's ``count``, ``kinds``.
    options: dict[str, Any] = Field(default_factory=dict)
    # "epoch": every problem once per epoch, in the source's order; "pass_rate": where groups are likely
    # to be mixed (``[data.pass_rate]``, ``retool.train.selection``).
    selection: Literal["epoch", "pass_rate"] = "epoch"
    pass_rate: PassRateConfig = Field(default_factory=PassRateConfig)


class RolloutConfig(_Section):
    questions_per_step: int = 8
    group_size: int = 8
    max_code_calls: int = 4
    max_assistant_turns: int = 6
    max_tokens_per_turn: int = 1024
    max_observation_tokens: int = 512
    max_trajectory_tokens: int = 8192
    max_inflight_samples: int = 64
    # Share of each round's questions rolled out text-only (no tool registered, the text-only system
    # prompt). 0 trains tool use alone (the chapter); a small share keeps the text-only mode from
    # collapsing while the tool-mode policy learns to call the tool.
    text_only_share: float = Field(default=0.0, ge=0.0, lt=1.0)


class FiltersConfig(_Section):
    """Which sampled groups and trajectories a step learns from. All off: the chapter's recipe."""

    # DAPO dynamic sampling: drop groups whose rewards are all equal (no gradient) and sample more
    # questions until ``rollout.questions_per_step`` informative groups are collected.
    dynamic_sampling: bool = False
    # Questions sampled per round = ceil(oversample * groups still missing); round 0 misses them all.
    oversample: float = Field(default=1.0, ge=1.0, le=16.0)
    max_extra_rounds: int = Field(default=2, ge=0)  # rounds after the first; then train on what there is
    # SimpleTIR: a trajectory whose last turn has neither a complete call nor an answer gets no gradient.
    void_turn: bool = False
    # A trajectory cut by a token budget (turn or trajectory) gets no gradient.
    overlong: bool = False
    # rStar2-Agent's Resample-on-Correct: sample ceil(roc_oversample x group_size) trajectories per
    # question, then keep group_size of them: failures uniformly at random, successes with the fewest tool
    # errors, then answer-format problems (``retool.train.roc``), and at least
    # min(failures sampled, roc_min_failures) failures.
    roc: bool = False
    roc_oversample: float = Field(default=2.0, ge=1.0, le=16.0)
    roc_min_failures: int = Field(default=1, ge=0)


class SamplingConfig(_Section):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # End a turn at its first closed \boxed{...} (local sampler): greedy evaluation reads nothing after the
    # answer, so the tokens a small model rambles on with are not computed. Off for RL (trained turns end
    # on the template's end of turn).
    stop_at_boxed: bool = False


class LossConfig(_Section):
    # cispo, dro, gspo and stable_reinforce: local backend only (``retool.backends.training.losses`` has the math)
    name: Literal["ppo", "importance_sampling", "cispo", "dro", "gspo", "stable_reinforce"] = "ppo"
    clip_low: float = 0.8  # ratio thresholds, not epsilons (ppo, cispo, gspo)
    clip_high: float = 1.28
    beta: float = Field(default=0.05, ge=0.0)  # dro's quadratic penalty
    kl_coeff: float = Field(default=0.0, ge=0.0)  # stable_reinforce's KL-to-sampler penalty
    ratio_cap: float = Field(default=2.0, gt=0.0)  # stable_reinforce's importance-weight cap
    # Truncated importance sampling: weight each token by min(exp(trainer lp - sampler lp), tis_cap) and
    # take the PPO ratio against the trainer's own pre-update logprob (``retool.backends.training.losses``).
    # 0: off (the ratio is taken against the sampler's logprob). Local backend only. "auto": DEFAULT_TIS_CAP
    # when the backend's sampler computes in other numerics than its trainer by design (bf16 sampling over
    # fp32 masters: backend.dtype), else off.
    tis_cap: Annotated[float, Field(ge=0.0)] | Literal["auto"] = "auto"
    # KL-to-start penalty: ref_kl_coef * k3(policy || start) added to every trained token's loss (the
    # GRPO / verl "KL loss"; ``retool.backends.training.losses``). The start is the LoRA adapter switched
    # off, so it needs the local backend with LoRA. 0: off (the KL is still measured: train.ref_kl_every).
    ref_kl_coef: float = Field(default=0.0, ge=0.0)


# loss.tis_cap = "auto" where sampler and trainer numerics differ by design (retool.train.loop.resolve_tis_cap)
DEFAULT_TIS_CAP = 2.0


class OptimizerConfig(_Section):
    lr: float = 4e-5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0


class SandboxConfig(_Section):
    backend: Literal["forkserver", "subprocess", "sandboxfusion"] = "forkserver"
    isolation: Literal["strict", "none"] = "strict"
    timeout: float = 30.0
    cpu_limit: float | None = None  # seconds; default timeout + 5
    memory_mb: int = 1024
    output_cap: int = 4096
    auto_print_last_expr: bool = False
    preimport: list[str] = Field(default_factory=lambda: ["math", "fractions", "itertools", "numpy", "sympy"])
    workers: int = 0  # 0: CPU count
    sandboxfusion_url: str = "http://127.0.0.1:8080"


class RewardConfig(_Section):
    verify_timeout: float = 5.0
    verify_workers: int = 2
    tail_chars: int = 300


# Each tracker's own modes (``retool.train.trackers``); SwanLab's "online" is its "cloud".
TRACKER_MODES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("local",),
    "swanlab": ("cloud", "online", "local", "offline", "disabled"),
    "wandb": ("online", "offline", "disabled"),
    "none": (),
}


class LoggingConfig(_Section):
    tracker: Literal["tensorboard", "swanlab", "wandb", "none"] = "tensorboard"
    # The tracker's own mode (``retool.train.trackers``): SwanLab cloud | local | offline | disabled,
    # W&B online | offline | disabled. "auto": SWANLAB_MODE / WANDB_MODE when set, else the cloud when
    # the tracker's credentials are present, else files in the run folder (SwanLab local, W&B offline).
    tracker_mode: Literal["auto", "cloud", "online", "local", "offline", "disabled"] = "auto"
    # false: a tracker that cannot start is a warning and the run goes on with metrics.jsonl alone.
    tracker_required: bool = True
    # Seconds W&B online may take to start (its init_timeout); SwanLab's cloud gives up after its own ~15 s.
    tracker_timeout: float = Field(default=30.0, gt=0)
    project: str = "retool"
    progress: bool = True
    # Groups of each step saved to trajectories.jsonl for `retool view` (0: none, "all": every group).
    trajectory_groups_per_step: Annotated[int, Field(ge=0)] | Literal["all"] = 2

    @model_validator(mode="after")
    def _check_tracker_mode(self) -> LoggingConfig:
        modes = TRACKER_MODES[self.tracker]
        if self.tracker_mode != "auto" and self.tracker_mode not in modes:
            raise ValueError(
                f"logging.tracker_mode = {self.tracker_mode!r} is not a mode of {self.tracker} "
                f"(one of {', '.join(('auto', *modes))})"
            )
        return self


class CheckpointConfig(_Section):
    every: int = 10
    keep_last: int = 3


class EvalConfig(_Section):
    """``retool eval``'s defaults (its flags override them). Sampling comes from ``[sampling]``."""

    dataset: str = "aime2025"  # an environment name or a path, as data.source
    val_n: int = Field(default=12, ge=1)  # candidates per problem (the N of Average@N)
    seed: int = 0
    concurrency: int = Field(default=4, ge=1)  # problems rolled out at once
    limit: int | None = Field(default=None, ge=1)  # only the first N problems
    save_transcripts: bool = False


class SFTOptimizerConfig(_Section):
    """The SFT stage's own AdamW settings (``[sft.optimizer]``), apart from RL's ``[optimizer]``: SFT and RL
    are tuned differently (a cross-entropy warm start at a high learning rate against a policy-gradient
    update on few informative groups), and verl and tinker-cookbook keep the two apart too. The defaults
    are the ones the SFT stage always trained with; its peak learning rate is ``sft.lr``."""

    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # 0 turns clipping off
    warmup: int = Field(default=10, ge=0)  # steps of linear warm-up before the cosine decay


class SFTConfig(_Section):
    """Cold-start SFT on code-interleaved trajectories (``retool sft``; a recipe's cold start)."""

    steps: int = Field(default=1500, ge=1)
    # > 0: the steps cover the examples this many times instead (``steps_for``), so a pool that grows (expert
    # iteration's) is trained on as thoroughly as a small one; 0: ``steps`` whatever the number of examples.
    epochs: float = Field(default=0.0, ge=0.0)
    batch_size: int = Field(default=16, ge=1)
    lr: float = 3e-3  # peak learning rate (linear warm-up, cosine decay to 10%: ``[sft.optimizer]``)
    optimizer: SFTOptimizerConfig = Field(default_factory=SFTOptimizerConfig)
    # The last ``final_share`` of the steps draw from a second set of trajectories (a recipe's: e.g. the
    # synthetic one's ``final_*`` styles). Cold start in two stages: first the skill (most hard problems
    # solved with the tool: calling and copying are learned), then the habit (a small share of calls), so
    # that *when* to call is left to RL. 0: one stage.
    final_share: float = Field(default=0.0, ge=0.0, le=1.0)
    # The local backend's SFT forwards under torch.autocast: off, bfloat16, or auto (bfloat16 where the
    # hardware computes it natively; ``retool.backends.local.precision.autocast_dtype``). The weights, the
    # optimizer and RL stay in backend.dtype.
    autocast: Literal["off", "bfloat16", "auto"] = "off"

    def steps_for(self, examples: int) -> int:
        """The steps of SFT on ``examples`` examples: ``steps``, or with ``epochs`` > 0 as many batches as
        cover them ``epochs`` times (at least one)."""
        if self.epochs <= 0:
            return self.steps
        return max(1, math.ceil(self.epochs * examples / self.batch_size))

    def final_steps_of(self, steps: int) -> int:
        """Of ``steps`` in all, those of the second stage (at least one when ``final_share`` > 0)."""
        return 0 if self.final_share <= 0 else max(1, round(self.final_share * steps))


class RetryConfig(_Section):
    """Timeouts and retries of calls to the training / sampling backend (``retool.backends.remote.guarded``)."""

    guard: Literal["remote", "always", "never"] = "remote"  # remote: pytrio / tinker only
    sample_timeout: float = Field(default=900.0, ge=0)  # seconds per sample request (0: none)
    call_timeout: float = Field(default=1800.0, ge=0)  # forward_backward, optim_step, save, load, refresh
    attempts: int = Field(default=4, ge=1)  # in all, the first included
    backoff: float = Field(default=2.0, ge=0)  # full-jitter exponential: uniform(0, backoff * 2^k)
    max_backoff: float = Field(default=60.0, ge=0)


class TrainConfig(_Section):
    steps: int = 200
    seed: int = 0
    run_dir: str = "runs/retool"
    # Off-policy pipelining (``retool.train.ahead``): the batch of step t is sampled by the policy of
    # version t - 1 - k (k optimizer steps behind the trainer) while steps t-k..t-1 train. 0: synchronous.
    max_steps_off_policy: int = Field(default=0, ge=0)
    # Stale-sampler check: on a step trained on-policy (lag 0), a mean |sampler - trainer logprob| above
    # this means the sampler did not sample from the trained weights (0: no check).
    sampler_check_tol: float = Field(default=0.05, ge=0.0)
    # Measure policy/ref_kl (KL to the starting policy, local backend with LoRA) every this many steps: one
    # extra forward without gradient per micro-batch (``LocalTrainingClient._reference_logprobs``). 0: never
    # (unless loss.ref_kl_coef > 0, which needs it every step).
    ref_kl_every: int = Field(default=1, ge=0)


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    filters: FiltersConfig = Field(default_factory=FiltersConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)

    retry: RetryConfig = Field(default_factory=RetryConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        """Settings that are valid alone but not together (each message says what to change)."""
        if not isinstance(self.loss.tis_cap, str) and self.loss.tis_cap > 0 and self.backend.kind != "local":
            raise ValueError(
                f"loss.tis_cap needs the loss computed locally; backend.kind = {self.backend.kind!r} "
                "computes it on the service (set loss.tis_cap = 0)"
            )
        if self.loss.name not in ("ppo", "importance_sampling") and self.backend.kind != "local":
            raise ValueError(
                f"loss.name = {self.loss.name!r} is computed by the local backend only; backend.kind = "
                f"{self.backend.kind!r} (use ppo or importance_sampling there)"
            )
        _check_roc(self.filters, self.rollout.group_size)
        _check_ref_kl(self)
        engine = self.backend.engine if self.backend.kind == "local" else "hf"
        if self.train.max_steps_off_policy > 0 and engine != "hf":
            raise ValueError(
                "train.max_steps_off_policy > 0 needs a sampler over a frozen copy of the weights; the "
                f"{engine} sampler holds one set of weights (use backend.engine = 'hf', or "
                "max_steps_off_policy = 0)"
            )
        if self.sampling.stop_at_boxed and (self.backend.kind != "local" or engine != "hf"):
            where = (
                f"backend.engine = {engine!r}"
                if self.backend.kind == "local"
                else f"backend.kind = {self.backend.kind!r}"
            )
            raise ValueError(
                f"sampling.stop_at_boxed is done by the local engine's own sampler only; with {where} it "
                "would be ignored (use backend.kind = 'local' with backend.engine = 'hf', or stop_at_boxed = false)"
            )
        return self


def _check_ref_kl(config: Config) -> None:
    """The KL-to-start penalty needs the starting policy's logprobs: the local backend's LoRA switched off."""
    coef = config.loss.ref_kl_coef
    if coef <= 0:
        return
    if config.backend.kind != "local":
        raise ValueError(
            f"loss.ref_kl_coef = {coef:g} needs the starting policy's logprobs, which only the local backend "
            f"computes; backend.kind = {config.backend.kind!r} (set loss.ref_kl_coef = 0)"
        )
    if not config.lora.enabled:
        raise ValueError(
            f"loss.ref_kl_coef = {coef:g} needs LoRA: the starting policy is the adapter switched off, and full "
            "fine-tuning (lora.enabled = false) keeps no copy of the starting weights (set loss.ref_kl_coef = 0)"
        )


def _check_roc(filters: FiltersConfig, group_size: int) -> None:
    """Resample-on-Correct needs room to choose: more trajectories sampled than kept, and a failure floor
    that fits in a group."""
    if not filters.roc:
        return
    if math.ceil(group_size * filters.roc_oversample - 1e-9) <= group_size:
        raise ValueError(
            f"filters.roc needs filters.roc_oversample x rollout.group_size > rollout.group_size to have "
            f"trajectories to drop; got {filters.roc_oversample} x {group_size} (set roc_oversample >= "
            f"{(group_size + 1) / group_size:.3g}, e.g. 2.0, or roc = false)"
        )
    if filters.roc_min_failures > group_size:
        raise ValueError(
            f"filters.roc_min_failures = {filters.roc_min_failures} exceeds rollout.group_size = "
            f"{group_size}: a group cannot keep more failures than it has trajectories"
        )


class ConfigError(UserError, ValueError):
    """A config file or override that cannot be used; the message says which and why."""


def _preset_files() -> dict[str, Traversable]:
    """Every named preset: the general ones in ``retool/presets/``, and each recipe's own beside its code
    (``retool/recipes/<recipe>/<preset>.toml``). Found as package files, not imported: a recipe sits above
    this module, and its preset is data the config reads."""
    root = resources.files("retool")
    folders = [root / "presets", *(f for f in (root / "recipes").iterdir() if f.is_dir())]
    found: dict[str, Traversable] = {}
    for folder in folders:
        for p in folder.iterdir():
            if not p.name.endswith(".toml"):
                continue
            name = p.name.removesuffix(".toml")
            if name in found:  # one flat namespace: a second file of one name must not win silently
                raise ConfigError(f"two presets named {name!r}: {found[name]} and {p}; rename one")
            found[name] = p
    return found


def preset_names() -> list[str]:
    return sorted(_preset_files())


def _read_toml(source: str | Path) -> dict[str, object]:
    path = Path(source)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif str(source) in (presets := _preset_files()):
        text = presets[str(source)].read_text(encoding="utf-8")
    else:
        raise ConfigError(
            f"no config file or preset named {str(source)!r} (presets: {', '.join(preset_names())})"
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc


def _parse_value(raw: str) -> object:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, object], overrides: list[str]) -> dict[str, object]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw.strip())
    return data


# A recipe's preset holds two tables beside the config's sections: ``[pipeline]``, the demo's own fields,
# and ``[recipe]``, the recipe's options (``retool.pipeline.recipe.from_preset`` reads and validates them).
RECIPE_TABLES = ("pipeline", "recipe")


def load_config(source: str | Path | None = None, overrides: Sequence[str] | None = None) -> Config:
    data: dict[str, object] = _read_toml(source) if source is not None else {}
    for table in RECIPE_TABLES:
        data.pop(table, None)
    apply_overrides(data, list(overrides or []))
    return _validate(data)


def recipe_tables(source: str | Path) -> dict[str, dict[str, object]]:
    """A preset's (or TOML file's) ``[pipeline]`` and ``[recipe]`` tables (empty where it has none)."""
    data = _read_toml(source)
    out: dict[str, dict[str, object]] = {}
    for table in RECIPE_TABLES:
        value = data.get(table, {})
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: [{table}] must be a table")
        out[table] = value
    return out


def override_config(config: Config, overrides: Sequence[str]) -> Config:
    """``config`` with ``section.key=value`` overrides applied (validated like a loaded file)."""
    if not overrides:
        return config
    return _validate(apply_overrides(config.model_dump(), list(overrides)))


def flag_overrides(flags: Mapping[str, object]) -> list[str]:
    """``section.key=value`` overrides for the command-line flags that were given (value not None).

    Every command's defaults live in the config; a flag is an override that applies only when passed.
    """
    return [f"{key}={_toml_literal(value)}" for key, value in flags.items() if value is not None]


def _validate(data: Mapping[str, object]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = [
            # A check across sections (``Config._check_combinations``) has no location of its own.
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        ]
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None  # one line: the CLI's


def dump_config(config: Config) -> str:
    """Render a config as TOML (saved beside every run so it can be reproduced)."""
    lines: list[str] = []
    for section, values in config.model_dump().items():
        _dump_table(lines, section, values)
    return "\n".join(lines)


def _dump_table(lines: list[str], name: str, values: Mapping[str, object]) -> None:
    """One ``[name]`` table, then its sub-tables (``[sft.optimizer]``) after its own keys, as TOML wants."""
    lines.append(f"[{name}]")
    lines.extend(
        f"{key} = {_toml_literal(v)}"
        for key, v in values.items()
        if v is not None and not isinstance(v, dict)
    )
    lines.append("")
    for key, v in values.items():
        if isinstance(v, dict):
            _dump_table(lines, f"{name}.{key}", v)


def _toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
