"""retool.sandbox: stateless execution of model-written Python (docs/spec.md §3, chapter 8.4.5).

Backends behind one ``Executor`` interface (``run``, ``arun``, ``format_tool_content``, ``stats``, ``close``):
- ``ForkServerExecutor`` (default): pool of pre-imported fork-servers, ``strict`` isolation via bubblewrap.
- ``SubprocessExecutor``: the chapter's reference, one fresh interpreter per call, NOT isolation.
- ``SandboxFusionExecutor``: HTTP client for a SandboxFusion service.
"""

from __future__ import annotations

from retool.sandbox.base import (
    ExecResult,
    Executor,
    ExecutorStats,
    SandboxWorkerError,
    format_tool_content,
    is_memory_failure,
)
from retool.sandbox.bwrap import strict_mode, strict_support
from retool.sandbox.forkserver import ForkServerExecutor, SandboxPreimportError, SandboxUnavailableError
from retool.sandbox.subprocess_executor import SubprocessExecutor

__all__ = [
    "ExecResult",
    "Executor",
    "ExecutorStats",
    "ForkServerExecutor",
    "SandboxFusionExecutor",
    "SandboxPreimportError",
    "SandboxUnavailableError",
    "SandboxWorkerError",
    "SubprocessExecutor",
    "format_tool_content",
    "is_memory_failure",
    "make_executor",
    "strict_mode",
    "strict_support",
]


# ``retool.sandbox`` imports with the standard library alone (a bare virtualenv runs its executors,
# tests/test_sandbox_environment.py), so the config (pydantic) and the SandboxFusion client (httpx) load on
# first use.
def __getattr__(name: str) -> object:
    if name == "SandboxFusionExecutor":
        from retool.sandbox.sandboxfusion import SandboxFusionExecutor  # deferred: httpx (see above)

        return SandboxFusionExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_executor(cfg: object) -> Executor:
    """Build the executor a ``retool.config.SandboxConfig`` describes."""
    from retool.config import SandboxConfig  # deferred: pydantic (see above)

    if not isinstance(cfg, SandboxConfig):
        raise TypeError(f"make_executor expects a SandboxConfig, got {type(cfg).__name__}")
    if cfg.backend == "forkserver":
        return ForkServerExecutor(
            timeout=cfg.timeout,
            cpu_limit=cfg.cpu_limit,
            memory_mb=cfg.memory_mb,
            output_cap=cfg.output_cap,
            auto_print=cfg.auto_print_last_expr,
            preimport=cfg.preimport,
            workers=cfg.workers,
            isolation=cfg.isolation,
        )
    if cfg.backend == "subprocess":
        return SubprocessExecutor(
            timeout=cfg.timeout,
            cpu_limit=cfg.cpu_limit,
            memory_mb=cfg.memory_mb,
            output_cap=cfg.output_cap,
            max_concurrency=cfg.workers,
            auto_print=cfg.auto_print_last_expr,
        )
    if cfg.backend == "sandboxfusion":
        from retool.sandbox.sandboxfusion import SandboxFusionExecutor  # deferred: httpx (see above)

        return SandboxFusionExecutor(
            cfg.sandboxfusion_url,
            timeout=cfg.timeout,
            memory_mb=cfg.memory_mb,
            output_cap=cfg.output_cap,
            max_concurrency=cfg.workers or 8,
        )
    raise ValueError(f"unknown sandbox backend {cfg.backend!r}")
