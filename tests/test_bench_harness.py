"""bench/harness.py: the shipped task is lm-eval's own ``gsm8k`` with only the data local, the results it
reads back, the project's own figure it sets beside them, the table and the page's scope note; and (slow)
lm-eval run end to end on a tiny local model."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import harness as bench  # noqa: E402  (bench/ is not a package)


def _lm_eval_file(*parts: str) -> Path | None:
    """A file of the installed lm_eval package, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def test_the_task_is_lm_evals_gsm8k_with_only_the_data_local() -> None:
    theirs_path = _lm_eval_file("tasks", "gsm8k", "gsm8k.yaml")
    if theirs_path is None:
        pytest.skip("lm_eval is not installed (pip install -e '.[harness]')")
    theirs = yaml.safe_load(theirs_path.read_text())
    ours = yaml.safe_load(bench.TASK_FILE.read_text())
    assert ours["task"] == bench.TASK and ours["dataset_path"] == "json"
    files = ours["dataset_kwargs"]["data_files"]
    assert files == {split: f"${{RETOOL_DATA_DIR}}/gsm8k_{split}.jsonl" for split in ("test", "train")}
    assert list(files) == ["test", "train"]  # the file with more columns first (the task file says why)
    for key in ("task", "dataset_path", "dataset_kwargs"):
        ours.pop(key)
    for key in ("tag", "task", "dataset_path", "dataset_name"):
        theirs.pop(key)
    assert ours == theirs  # prompt, 5-shot, generation, metric and both filters unchanged


def test_the_task_folder_names_the_data_folder_and_a_missing_file_says_how_to_fetch(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k_test.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match=r"gsm8k_train\.jsonl not in .*retool data fetch gsm8k"):
        bench.task_folder(data, tmp_path / "tasks")
    (data / "gsm8k_train.jsonl").write_text("{}\n")
    folder = bench.task_folder(data, tmp_path / "tasks")
    task = yaml.safe_load((folder / "gsm8k_local.yaml").read_text())
    assert task["dataset_kwargs"]["data_files"]["test"] == str(data.resolve() / "gsm8k_test.jsonl")
    assert "${" not in (folder / "gsm8k_local.yaml").read_text()


def _results(strict: float, flexible: float, n: int, stderr: object = 0.05) -> dict:
    return {
        "results": {
            bench.TASK: {
                "alias": bench.TASK,
                "exact_match,strict-match": strict,
                "exact_match_stderr,strict-match": stderr,
                "exact_match,flexible-extract": flexible,
                "exact_match_stderr,flexible-extract": stderr,
            }
        },
        "n-samples": {bench.TASK: {"original": 1319, "effective": n}},
    }


def test_results_read_back_with_both_filters_and_the_questions_scored() -> None:
    score = bench.parse_results(_results(0.05, 0.1, 20))
    assert (score.strict, score.flexible, score.questions) == (0.05, 0.1, 20)
    assert score.strict_se == 0.05
    one = bench.parse_results(_results(0.0, 1.0, 1, stderr="N/A"))  # lm-eval's stderr of one question
    assert one.strict_se != one.strict_se and bench.pct_se(one.flexible, one.flexible_se) == "100.0%"


def test_the_table_sets_the_projects_figure_and_the_card_beside_lm_eval() -> None:
    scores = {
        "base": bench.parse_results(_results(0.0, 0.05, 20)),
        "rl": bench.parse_results(_results(0.1, 0.15, 20)),
    }
    scores["base"].answered = 0.9
    own = {"base": bench.Own(0.0, 1319, "docs/results/gsm8k.md"), "rl": None}
    lines = bench.table(scores, own).splitlines()
    assert lines[2] == (
        "| base | 20 | 90% | 0.0% ± 5.0 | 5.0% ± 5.0 | 0.0% of 1,319 (docs/results/gsm8k.md) | 1.4% |"
    )
    assert (
        lines[3] == "| rl | 20 | - | 10.0% ± 5.0 | 15.0% ± 5.0 | - | - |"
    )  # the card's figure is the base model's


def test_the_samples_give_the_questions_and_the_share_answered_in_gsm8ks_format() -> None:
    def row(doc_id: int, flt: str, answer: str) -> dict:
        return {"doc_id": doc_id, "doc": {"idx": 100 + doc_id}, "filter": flt, "filtered_resps": [answer]}

    rows = [row(0, "strict-match", "54"), row(0, "flexible-extract", "54")]
    rows += [row(1, "strict-match", "[invalid]"), row(1, "flexible-extract", "3")]
    assert bench.sample_ids(rows) == ["gsm8k-100", "gsm8k-101"]
    assert bench.answered_share(rows) == 0.5
    assert bench.answered_share([]) != bench.answered_share([])  # NaN: no samples


def test_the_projects_base_figure_is_its_published_whole_split_row() -> None:
    own = bench.own_text_only("base", None, [])
    assert own is not None and own.problems == 1319 and own.source == "docs/results/gsm8k.md"
    row = "| sft | text-only | 1319 | 1.4% | 57.1% | 0.0% | 0.00 | 77 |"
    sft = bench.own_from_table("sft", row, "x")
    assert sft is not None and (round(sft.accuracy, 6), sft.problems) == (0.014, 1319)
    assert bench.own_from_table("rl", row, "x") is None


def _record(idx: int, correct: bool) -> dict:
    candidate = {"correct": correct, "valid_format": True, "code_calls": 0, "completion_tokens": 10}
    return {"id": f"gsm8k-{idx}", "mode": "text-only", "candidates": [candidate]}


def test_the_projects_figure_is_read_on_the_same_questions_where_its_records_hold_them(
    tmp_path: Path,
) -> None:
    # A seed folder of bench/gsm8k.py: its whole-split records beside it, in full/.
    demo = tmp_path / "seed1"
    (tmp_path / "full").mkdir(parents=True)
    rows = [_record(i, i % 2 == 0) for i in range(10)]
    (tmp_path / "full" / "rl-s1_text-only.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    same = bench.own_text_only("rl", demo, ["gsm8k-0", "gsm8k-2"])
    assert same == bench.Own(1.0, 2, "bench/gsm8k.py, full/rl-s1_text-only.jsonl")
    every = bench.own_text_only("rl", demo, ["gsm8k-0", "gsm8k-99"])  # not all there: every record
    assert every is not None and (every.accuracy, every.problems) == (0.5, 10)
    # A plain demo: its own evaluation slice in eval/.
    plain = tmp_path / "demo"
    (plain / "eval").mkdir(parents=True)
    (plain / "eval" / "sft_text-only.jsonl").write_text(json.dumps(_record(3, True)) + "\n")
    assert bench.own_text_only("sft", plain, []) == bench.Own(1.0, 1, "the demo's eval/")
    assert bench.own_text_only("rl", plain, []) is None


def test_the_lm_eval_command_and_the_page_say_what_a_slice_is() -> None:
    cmd = bench.lm_eval_command(Path("m"), Path("t"), Path("o"), 20, 8, "bfloat16")
    assert cmd[1:4] == ["-m", "lm_eval", "run"] and cmd[-2:] == ["--limit", "20"]
    assert "pretrained=m,dtype=bfloat16" in cmd and "--log_samples" in cmd
    assert cmd[cmd.index("--use_cache") + 1] == str(Path("o") / "cache" / "lm-eval")  # what a rerun resumes
    assert "--limit" not in bench.lm_eval_command(Path("m"), Path("t"), Path("o"), 0, 8, "float32")
    note = bench.scope_note(20, None)
    assert "first 20 of GSM8K's 1,319" in note and "pending" in note and "--demo DIR" in note
    assert bench.scope_note(0, Path("d")) == ""


def test_with_a_server_lm_eval_sends_the_tasks_text_prompts_to_it(tmp_path: Path) -> None:
    cmd = bench.lm_eval_command(Path("x/sft"), Path("t"), Path("o"), 0, 16, "bfloat16", "http://h:1")
    args = dict(kv.split("=", 1) for kv in cmd[cmd.index("--model_args") + 1].split(","))
    assert cmd[cmd.index("--model") + 1] == "local-completions" and "--batch_size" not in cmd
    assert args["base_url"] == "http://h:1/v1/completions" and args["model"] == "sft"
    assert args["num_concurrent"] == "16" and args["tokenized_requests"] == "False"
    assert int(args["timeout"]) >= 3600  # a CPU server answers 16 requests in flight slowly
    assert args["tokenizer"] == str(Path("x/sft")) and "--use_cache" in cmd
    server = bench.VllmServer(
        tmp_path / "sft", "bfloat16", tmp_path / "vllm.log", python=Path(sys.executable)
    )
    served = server.command()
    assert served[served.index("--served-model-name") + 1] == "sft"  # the name lm-eval's requests carry
    assert served[served.index("--dtype") + 1] == "bfloat16" and str(server.port) in served
    assert "PYTHONPATH" not in server.env() and server.env()["HF_HUB_OFFLINE"] == "1"


def test_the_vllm_engine_without_its_environment_says_how_to_build_it_or_what_else(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"setup_vllm\.sh.*--engine hf"):
        bench.VllmServer(tmp_path, "bfloat16", tmp_path / "log", python=tmp_path / "absent" / "python")


def test_answers_of_another_export_of_a_model_are_not_read_back(tmp_path: Path) -> None:
    """lm-eval's cache is keyed by the prompt: a model exported again (retrained) starts from nothing."""
    model, out = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    (model / "export.json").write_text('{"mtime": 1}')
    bench.forget_another_export(out, model)
    (out / "cache").mkdir()
    (out / "cache" / "lm-eval_rank0.db").write_text("answers")
    bench.forget_another_export(out, model)  # the same export: kept
    assert (out / "cache" / "lm-eval_rank0.db").is_file()
    (model / "export.json").write_text('{"mtime": 2}')
    bench.forget_another_export(out, model)
    assert not (out / "cache").exists() and (out / "model.json").read_text() == '{"mtime": 2}'


def test_the_time_line_names_the_engines_setting_and_a_resumed_models_attempts() -> None:
    scores = {"base": bench.Score(0.0, 0.0, 0.0, 0.0, 100)}
    timing = {"seconds": 250.0, "server_seconds": 50.0, "attempts": 2, "batch_size": 16, "threads": 0}
    line = bench.timing_line({"base": timing}, scores, "bfloat16", "vllm")
    assert "16 requests in flight" in line and "base 250 s, 2.5 s a question" in line
    assert "50 s of it the server's start" in line and "2 attempts: a rerun resumes" in line
    hf = bench.timing_line(
        {"base": {"seconds": 100.0, "batch_size": 8, "threads": 1}}, scores, "float32", "hf"
    )
    assert "batch 8, 1 torch thread" in hf and "attempts" not in hf and "server" not in hf
    # A model resumed at another number of requests in flight says so; one run at the headline's does not.
    resumed = {**timing, "batch_sizes": [16, 64]}
    both = bench.timing_line(
        {"base": {**timing, "batch_sizes": [16]}, "sft": resumed},
        scores | {"sft": scores["base"]},
        "bfloat16",
        "vllm",
    )
    assert both.count("at 16 then 64 requests in flight") == 1 and both.index("sft 250 s") < both.index(
        "then 64"
    )


def test_models_named_on_the_command_line_replace_the_default_set(tmp_path: Path) -> None:
    assert bench.model_sources(None, [f"tiny={tmp_path}"]) == {"tiny": tmp_path}
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        bench.model_sources(None, [f"tiny={tmp_path / 'absent'}"])
    with pytest.raises(SystemExit, match="no model_sft or model_rl"):
        bench.model_sources(tmp_path)


def test_an_attempts_time_is_kept_while_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # lm-eval stood in for by a process that prints the attempts file half-way through its run: an attempt
    # killed outright (the machine taken away) must not lose its time.
    out, model = tmp_path / "run", tmp_path / "model"
    model.mkdir()
    attempts = out / "attempts.json"
    peek = (
        f"import time, pathlib; time.sleep(1.0); print('SEEN', pathlib.Path({str(attempts)!r}).read_text())"
    )
    monkeypatch.setattr(bench, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(bench, "lm_eval_command", lambda *a, **k: [sys.executable, "-c", peek])
    args = bench.parse_args(["--engine", "hf", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="lm-eval failed"):  # no results file: the stand-in wrote none
        bench.run_lm_eval(model, out, tmp_path, args)
    seen = json.loads((out / "lm_eval.log").read_text().split("SEEN", 1)[1])
    assert seen["count"] == 1 and 0.4 < seen["seconds"] < 1.5
    final = json.loads(attempts.read_text())
    assert final["count"] == 1 and final["seconds"] >= 1.0 and final["batch_sizes"] == [args.batch_size]


def test_samples_keep_a_record_whose_answer_holds_a_line_separator(tmp_path: Path) -> None:
    rows = [
        {"doc_id": 0, "doc": {"idx": 7}, "filter": "strict-match", "filtered_resps": ["[invalid]"]},
        {"doc_id": 0, "doc": {"idx": 7}, "filter": "flexible-extract", "filtered_resps": ["3\u2028"]},
    ]
    text = "\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n"
    assert "\u2028" in text  # written raw, as lm-eval writes a model's continuation
    (tmp_path / f"samples_{bench.TASK}_2026.jsonl").write_text(text, encoding="utf-8")
    read = bench.samples(tmp_path)
    assert read == rows and bench.sample_ids(read) == ["gsm8k-7"] and bench.answered_share(read) == 0.0


@pytest.mark.slow
def test_lm_eval_runs_the_local_task_on_a_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install -e '.[harness]')")
    data = REPO / "tests" / "data"  # a few dozen GSM8K rows of each split
    out = tmp_path / "bench"
    argv = ["--model", f"tiny={tiny_model_dir}", "--limit", "2", "--batch-size", "2", "--threads", "1"]
    argv += ["--engine", "hf", "--dtype", "float32", "--data-dir", str(data), "--out", str(out)]
    bench.main(argv)
    printed = capsys.readouterr().out
    assert "| tiny | 2 | " in printed and "Where the evaluators differ" in printed
    assert "transformers backend" in printed
    run = out / "first2" / "hf-float32" / "tiny"
    scores = bench.parse_results(json.loads(bench.results_file(run).read_text()))
    assert scores.questions == 2 and 0.0 <= scores.flexible <= 1.0
    rows = bench.samples(run)
    assert len(bench.sample_ids(rows)) == 2 and 0.0 <= bench.answered_share(rows) <= 1.0
    assert "Read back from finished run folders" not in printed
    # A rerun with the same settings reads the finished model back instead of running lm-eval again.
    log = run / "lm_eval.log"
    before = log.read_text()
    bench.main(argv)
    assert log.read_text() == before
    assert "Read back from finished run folders, not run by the command that wrote this page: tiny;" in (
        capsys.readouterr().out
    )
    # Stopped before its results were written, a model resumes from lm-eval's cache of its answers.
    for finished in [bench.results_file(run), run / "run.json"]:
        assert finished is not None
        finished.unlink()
    bench.main(argv)
    assert "Cached requests: 2, Requests remaining: 0" in log.read_text()
    assert json.loads((run / "run.json").read_text())["attempts"] == 2


def _tiny_llama(folder: Path) -> Path:
    """A random tiny Llama model vLLM's CPU build runs (head size 32: its CPU attention takes 32 to 512),
    with positions for the tiny tokenizer's long five-shot prompts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from retool.backends.local.tinymodel import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_lm_eval_runs_the_local_task_through_vllms_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default engine end to end: vLLM's CPU build (.venv-vllm) serves the exported folder, lm-eval
    sends it the task; skipped without that environment, except under CI, which builds it."""
    pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install -e '.[harness]')")
    if not bench.VLLM_PYTHON.exists():
        message = f"no vLLM environment at {bench.VLLM_PYTHON.parent.parent}: run scripts/setup_vllm.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI builds it through scripts/setup.sh --dev)")
        pytest.skip(message)
    monkeypatch.setattr(bench, "VLLM_MAX_MODEL_LEN", 8192)  # the tiny tokenizer's prompts are long
    model = _tiny_llama(tmp_path / "llama")
    out = tmp_path / "bench"
    argv = ["--model", f"llama={model}", "--limit", "2", "--batch-size", "2", "--dtype", "float32"]
    argv += ["--data-dir", str(REPO / "tests" / "data"), "--out", str(out)]
    bench.main(argv)
    printed = capsys.readouterr().out
    assert "| llama | 2 | " in printed and "vLLM's CPU build" in printed and "2 requests in flight" in printed
    run = out / "first2" / "vllm-float32" / "llama"
    assert bench.parse_results(json.loads(bench.results_file(run).read_text())).questions == 2
    assert "Application startup complete" in (run / "vllm.log").read_text()
    timing = json.loads((run / "run.json").read_text())
    assert timing["engine"] == "vllm" and timing["attempts"] == 1 and timing["server_seconds"] > 0
