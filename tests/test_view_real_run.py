"""A real training step (tiny model, real tokenizer, chat template, sandbox and verifier) writes records the
viewer can show: spans decode to the real sequence and match the datum the backend trained on."""

from __future__ import annotations

import json
from pathlib import Path

from retool.config import load_config
from retool.train.records import TRAJECTORIES_FILE, read_records
from retool.train.step import trajectory_tokens
from retool.view.site import build_site


def test_one_real_step_gives_viewable_records(tiny_model_dir: Path, tmp_path: Path) -> None:
    from retool.components import build_components
    from retool.env import source_from_config
    from retool.train.loop import Trainer
    from train_harness import ParityScoredSource

    cfg = load_config(
        "tiny",
        [
            f"model.name={json.dumps(str(tiny_model_dir))}",
            "data.options.count=20",
            "train.steps=1",
            "checkpoint.every=0",
            "rollout.questions_per_step=2",
            "rollout.group_size=4",
            "rollout.max_tokens_per_turn=24",
            "rollout.max_trajectory_tokens=1400",
            "backend.sample_batch_size=8",
            "sandbox.workers=1",
            "sandbox.preimport=[]",
            "reward.verify_workers=1",
            "logging.tracker='none'",
            "logging.progress=false",
            "logging.trajectory_groups_per_step='all'",
        ],
    )
    parts = build_components(cfg)
    client = parts.backend
    trained: list = []
    real_forward_backward = client.forward_backward_async

    async def spy(datums, loss_fn, loss_config=None):
        trained.extend(datums)
        return await real_forward_backward(datums, loss_fn, loss_config)

    client.forward_backward_async = spy
    # Parity rewards make the random model's groups mixed, so its datums are actually trained.
    trainer = Trainer(
        cfg, tmp_path / "run", source=ParityScoredSource(source_from_config(cfg)), components=parts
    )
    written: dict = {}
    real_write = trainer.trajectories.write_step

    def spy_write(step, groups, data, origin=(), decode=None):
        written.update(groups=groups, decode=decode)
        return real_write(step, groups, data, origin, decode)

    trainer.trajectories.write_step = spy_write
    try:
        trainer.run()
    finally:
        parts.close()
    records = list(read_records(tmp_path / "run" / TRAJECTORIES_FILE))
    assert len(records) == 8 and {r["step"] for r in records} == {1}
    assert written["decode"] is not None  # the protocol's own decode: the text is the tokens' text
    by_tokens = {(*d.input_tokens, d.target_tokens[-1]): d for d in trained}
    seen_datum = 0
    for r in records:
        traj = written["groups"][r["group"]][r["group_index"]]
        tokens = trajectory_tokens(traj)[0]
        assert r["spans"][0]["role"] == "prompt" and r["question"] in r["spans"][0]["text"]
        for s in r["spans"]:
            assert s["text"] == written["decode"](tokens[s["start"] : s["end"]])
        assert r["spans"][-1]["end"] == len(tokens)
        trained_here = {j for s in r["spans"] if s["trained"] for j in range(s["start"], s["end"])}
        datum = by_tokens.get(tuple(tokens))
        if datum is None:  # not trained (a degenerate group): says so, marks nothing trained
            assert r["mask_source"] == "untrained" and not trained_here
            continue
        seen_datum += 1
        assert r["mask_source"] == "datum"
        assert trained_here == {j + 1 for j, w in enumerate(datum.weights) if w != 0.0}
    assert seen_datum > 0
    site = build_site([tmp_path / "run"], tmp_path / "site")
    assert site.trajectories == 8
