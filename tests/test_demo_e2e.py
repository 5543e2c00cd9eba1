"""End to end: the demo's RL, not its SFT, carries the result on held-out problems.

Measured, not asserted from constants: both evaluations run the SFT and the RL policy on the same 200
held-out synthetic problems (N = 4 samples each) with the same sampling settings, sandbox and verifier.

Why these thresholds hold on any CPU: another CPU's float rounding sends a run down a different path, as
another seed does, so the margin comes from the spread over seeds. ``bench/learning.py`` (seeds 0..4, the
demo's defaults, a 2-core AMD EPYC with AVX2 only; docs/demo.md, "Earlier measurements") measured a
retool-mode gain of +28.5 to +37.4 points Average@4 (mean +32.3, sd 3.3 over seeds; every 95% paired interval's lower end at
+22.9 or above) and a hard-problem gain of +64.8 to +82.1 points (mean +73.2, sd 7.3). The test asks for the
issue's targets, +15 and +25 points: 4.0 and 5.4 standard deviations (over seeds) below the smallest gains
measured, so a run that misses them has lost the learning, not a few problems.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retool.pipeline.settings import DemoSettings
from retool.recipes.demo import run_demo

MIN_GAIN = 0.15  # Average@4, retool mode, RL minus SFT (paired, same problems)
MIN_HARD_GAIN = 0.25  # accuracy on the hard problems


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rl_beats_sft_on_held_out_tasks(tmp_path: Path) -> None:
    settings = DemoSettings(out=str(tmp_path / "demo"), plots=False)  # the demo preset: seed 0
    result = run_demo(settings)
    report = json.loads((result.out / "report.json").read_text())
    sft, rl = report["evals"]["sft"]["retool"], report["evals"]["rl"]["retool"]
    gain = report["gain"]
    print(json.dumps({"gain": gain, "sft": sft, "rl": rl, "timings": report["timings"]}, indent=1))

    # The SFT policy is a protocol-valid starting point (the chapter's check before RL) that can use the
    # tool but seldom does where it should ...
    assert sft["format_rate"] > 0.9
    assert sft["hard_tool_call_rate"] < 0.5
    # ... and RL improves what it was rewarded for, on problems it never trained on, beyond noise.
    avg = gain["average_at_n"]
    assert avg["problems"] >= 200
    assert avg["gain"] >= MIN_GAIN, avg
    assert avg["ci95"][0] > 0.0, avg
    assert gain["hard_accuracy"]["gain"] >= MIN_HARD_GAIN, gain["hard_accuracy"]
    assert rl["hard_tool_call_rate"] >= sft["hard_tool_call_rate"] + 0.3
    # Text-only mode has no interpreter: it cannot solve the hard problems, before or after.
    assert report["evals"]["rl"]["text-only"]["hard_tool_call_rate"] == 0.0
    for name in ("report.md", "model_sft/config.json", "model_rl/config.json", "rl/metrics.jsonl"):
        assert (result.out / name).exists(), name
