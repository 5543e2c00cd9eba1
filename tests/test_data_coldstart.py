"""Cold-start trajectories from GSM8K's annotated solutions: parsing, real sandbox outputs, the drop reasons,
token-exact sequences for the real Qwen tokenizers, and ``retool data coldstart`` end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.config import RolloutConfig, SandboxConfig
from retool.data.annotated import ParseFailure, matches_result, parse_solution, python_expression
from retool.data.problem import Problem
from retool.protocol import ChatProtocol
from retool.sandbox import make_executor
from retool.sandbox.base import Executor
from retool.train.annotated import Dropped, caching_observer, convert_file, convert_solution
from retool.train.sft import assistant_spans, budget_violation, read_examples, write_examples


def _rows(path: Path) -> int:
    return sum(1 for line in path.open(encoding="utf-8") if line.strip())


def _train_rows(fixture_data: Path, n: int) -> list[dict[str, str]]:
    with (fixture_data / "gsm8k_train.jsonl").open() as fh:
        return [json.loads(next(fh)) for _ in range(n)]


@pytest.fixture(scope="module")
def executor() -> Iterator[Executor]:
    with make_executor(SandboxConfig(isolation="none", preimport=[], workers=1)) as ex:
        yield ex


def test_parse_real_row_into_steps(fixture_data: Path) -> None:
    row = _train_rows(fixture_data, 1)[0]  # Natalia: 48/2 = <<48/2=24>>24 ... 48+24 = <<48+24=72>>72
    parsed = parse_solution(row["answer"])
    assert not isinstance(parsed, ParseFailure)
    assert [(s.expression, s.result) for s in parsed.steps] == [("48/2", "24"), ("48+24", "72")]
    assert parsed.steps[0].text.strip() == "Natalia sold 48/2 ="
    assert parsed.steps[1].text.startswith("24 clips in May.")
    assert parsed.answer == "72"


def test_expressions_and_results() -> None:
    assert python_expression("1,200*3") == "1200*3"
    assert python_expression("2^3") == "2**3"
    assert python_expression("50%*80") == "(50/100)*80"
    assert python_expression("import os") is None
    assert python_expression("05+3") is None
    # Leading-dot decimals and trailing zeros, as GSM8K writes them (rows 27 and 243 of the train split).
    assert python_expression("2*20*.01") == "2*20*.01" and python_expression("12.50+5.00") == "12.50+5.00"
    assert matches_result("0.5\n", ".5") and matches_result("0.19999999999999998", ".2")
    assert matches_result("24.0\n", "24")
    assert matches_result("3.3333333333333335", "3.33")
    assert not matches_result("3.34", "3.33") and not matches_result("25", "24")


def _protocols(qwen_tokenizers: dict, fixture_data: Path) -> dict[str, ChatProtocol]:
    nothink = fixture_data / "tokenizers" / "Qwen3.5" / "chat_template_nothink.jinja"
    return {
        "hermes": ChatProtocol(qwen_tokenizers["Qwen2.5-Instruct"]),
        "markdown": ChatProtocol(qwen_tokenizers["Qwen2.5-Instruct"], fmt="markdown"),
        "qwen_xml": ChatProtocol(qwen_tokenizers["Qwen3.5"], chat_template=nothink),
    }


def _spans(tokens: list[int], weights: list[float]) -> list[list[int]]:
    spans: list[list[int]] = []
    cur: list[int] = []
    for tok, w in zip(tokens, weights, strict=True):
        if w:
            cur.append(tok)
        elif cur:
            spans, cur = [*spans, cur], []
    return [*spans, cur] if cur else spans


@pytest.mark.parametrize("per_call", [1, 0], ids=["call-per-step", "folded"])
@pytest.mark.parametrize("fmt", ["hermes", "markdown", "qwen_xml"])
def test_trajectory_is_the_template_render_token_for_token(
    qwen_tokenizers: dict, fixture_data: Path, executor: Executor, fmt: str, per_call: int
) -> None:
    protocol = _protocols(qwen_tokenizers, fixture_data)[fmt]
    assert protocol.fmt.name == fmt
    row = _train_rows(fixture_data, 3)[2]  # Betty: three annotated steps
    problem = Problem("betty", row["question"], "5")
    ex = convert_solution(problem, row["answer"], protocol, caching_observer(executor), per_call=per_call)
    # The conversation the trajectory claims, rebuilt from its assistant spans and the sandbox's outputs.
    end = protocol.decode([protocol.end_of_turn_id])
    texts = [protocol.decode(s) for s in _spans(ex.tokens, ex.weights)]
    assert all(t.endswith(end) for t in texts) and texts[-1].endswith("\\boxed{5}" + end)
    assert len(texts) == {1: 4, 0: 2}[per_call]
    messages = protocol.initial_messages(problem.question)
    codes = []
    for text in texts[:-1]:
        parsed = protocol.fmt.parse(text[: -len(end)])
        assert parsed.kind == "tool" and parsed.code
        codes.append(parsed.code)
        observation = executor.format_tool_content(executor.run(parsed.code))
        messages += [protocol.assistant_message(text), protocol.tool_message(observation)]
    assert codes[0].startswith("print(100/2)")
    messages.append(protocol.assistant_message(texts[-1]))
    full = protocol.encode(protocol.render(messages, add_generation_prompt=False))
    closing = protocol.closing_tokens(messages[:-1])
    assert [*ex.tokens, *closing[1:]] == full  # token-exact: the template's own render of the whole thing
    assert (
        "50.0" in ex.text and "30" in ex.text
    )  # the REAL outputs (48/2 prints 24.0, not the annotation's 24)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_convert_real_rows_and_count_every_drop(
    qwen_tokenizers: dict, fixture_data: Path, executor: Executor, tmp_path: Path
) -> None:
    rows = _train_rows(fixture_data, 12)
    wrong = dict(rows[0], answer=rows[0]["answer"].replace("<<48/2=24>>", "<<48/2=25>>"))
    unparsable = dict(rows[1], answer=rows[1]["answer"].replace("<<12/60=0.2>>", "<<12/60>>"))
    crashing = dict(rows[3], answer=rows[3]["answer"].replace("<<12*2=24>>", "<<12/0=24>>"))
    lines = [json.dumps(r) for r in rows]
    lines += [json.dumps(x) for x in (wrong, unparsable, crashing)]
    lines += [
        "{not json",
        json.dumps({"question": "q"}),
        json.dumps({"question": "q", "answer": "no annotation\n#### 3"}),
    ]
    lines += [json.dumps({"question": "q", "answer": "2+2 = <<2+2=4>>4"})]
    protocol = _protocols(qwen_tokenizers, fixture_data)["hermes"]
    examples, report = convert_file(_write(tmp_path / "in.jsonl", lines), protocol, executor)
    assert report.read == len(lines) == report.kept + sum(report.dropped.values())  # nothing lost
    assert (
        report.dropped["observation_mismatch"] >= 1 and "48/2" in report.examples_of["observation_mismatch"]
    )
    assert "row 13" in report.examples_of["observation_mismatch"]
    assert (
        report.dropped["unparsable_annotation"] >= 1
        and "<<12/60>>" in report.examples_of["unparsable_annotation"]
    )
    assert (
        report.dropped["execution_error"] == 1
        and "ZeroDivisionError" in report.examples_of["execution_error"]
    )
    assert report.dropped["invalid_json"] == 1 and report.dropped["missing_field"] == 1
    assert report.dropped["no_annotation"] == 1 and report.dropped["no_final_answer"] == 1
    assert report.kept == len(examples) >= 9  # the clean real rows convert
    assert report.calls == sum(ex.text.count('"arguments": {"code"') for ex in examples)
    # Written, read back, and ready for the SFT stage.
    write_examples(examples, tmp_path / "out.jsonl")
    back = read_examples(tmp_path / "out.jsonl")
    assert [(b.tokens, b.weights, b.task.id) for b in back] == [
        (e.tokens, e.weights, e.task.id) for e in examples
    ]
    datum = back[0].to_datum()
    assert datum.input_tokens == back[0].tokens[:-1] and len(datum.weights) == len(datum.target_tokens)


def test_a_wrong_final_answer_is_dropped(
    qwen_tokenizers: dict, fixture_data: Path, executor: Executor
) -> None:
    row = _train_rows(fixture_data, 1)[0]
    protocol = _protocols(qwen_tokenizers, fixture_data)["hermes"]
    with pytest.raises(Dropped) as err:
        convert_solution(
            Problem("p", row["question"], "73"), row["answer"], protocol, caching_observer(executor)
        )
    assert err.value.reason == "answer_not_verified"


def test_a_test_question_is_never_converted(
    qwen_tokenizers: dict, fixture_data: Path, executor: Executor, tmp_path: Path
) -> None:
    with (fixture_data / "gsm8k_test.jsonl").open() as fh:
        test_row = json.loads(next(fh))
    rows = [
        *_train_rows(fixture_data, 2),
        {"question": test_row["question"].lower(), "answer": "1+1 = <<1+1=2>>2\n#### 2"},
    ]
    protocol = _protocols(qwen_tokenizers, fixture_data)["hermes"]
    src = _write(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    examples, report = convert_file(src, protocol, executor, held_out=[test_row["question"]])
    assert len(examples) == 2
    assert report.kept == 2 and report.dropped == {"test_question": 1}
    assert report.rejects == [
        {"row": 3, "reason": "test_question", "detail": "the question is a held-out test question"}
    ]
    _, unguarded = convert_file(src, protocol, executor)
    assert unguarded.kept == 3  # the check is what dropped it


def test_retool_data_coldstart_command(fixture_data: Path, tmp_path: Path) -> None:
    from retool.cli import app

    rows = _train_rows(fixture_data, 4)
    src = _write(tmp_path / "in.jsonl", [json.dumps(r) for r in rows] + ["[1, 2]"])
    held_out = str(fixture_data / "gsm8k_test.jsonl")
    out = tmp_path / "out.jsonl"
    model = str(fixture_data / "tokenizers" / "Qwen2.5-Instruct")
    result = CliRunner().invoke(
        app, ["data", "coldstart", "-i", str(src), "-o", str(out), "--model", model, "--held-out", held_out]
    )
    assert result.exit_code == 0, result.output
    assert "read:    5" in result.output and "kept:    4" in result.output
    assert "invalid_json: 1" in result.output and "not a JSON object" in result.output
    assert (
        len(out.read_text().splitlines()) == 4
        and f"held out: {_rows(fixture_data / 'gsm8k_test.jsonl')} test questions" in result.output
    )
    rejects = [json.loads(line) for line in (tmp_path / "out.dropped.jsonl").read_text().splitlines()]
    assert rejects == [{"row": 5, "reason": "invalid_json", "detail": "not a JSON object"}]
    missing = CliRunner().invoke(
        app, ["data", "coldstart", "-i", str(tmp_path / "nope"), "-o", str(out), "--model", model]
    )
    assert missing.exit_code == 2 and "no such file" in missing.output
    bad_format = CliRunner().invoke(
        app, ["data", "coldstart", "-i", str(src), "-o", str(out), "--model", model, "--tool-format", "xml"]
    )
    assert bad_format.exit_code == 2 and "unknown tool format 'xml'" in bad_format.output


def test_rows_and_budgets_select_what_the_rollout_could_produce(
    qwen_tokenizers: dict, fixture_data: Path, executor: Executor, tmp_path: Path
) -> None:
    protocol = _protocols(qwen_tokenizers, fixture_data)["hermes"]
    src = _write(tmp_path / "in.jsonl", [json.dumps(r) for r in _train_rows(fixture_data, 12)])
    picked, report = convert_file(src, protocol, executor, rows={2, 3, 11})
    assert report.read == 3 and sorted(e.task.id for e in picked) == ["row-11", "row-2", "row-3"]
    everything, _ = convert_file(src, protocol, executor)
    budgets = RolloutConfig(max_code_calls=2, max_assistant_turns=3, max_tokens_per_turn=1024)
    fitting, tight = convert_file(src, protocol, executor, budgets=budgets)
    too_many = [e for e in everything if len(assistant_spans(e.weights)) - 1 > 2]
    assert too_many and tight.dropped["over_budget"] == len(too_many)
    assert len(fitting) + len(too_many) == len(everything)
    assert "calls > max_code_calls 2" in tight.examples_of["over_budget"]
    assert all(budget_violation(e, budgets) is None for e in fitting)
    # Each assistant turn is one trained span; a turn over its token budget is named.
    ex = everything[0]
    assert len(assistant_spans(ex.weights)) == ex.text.count('"arguments": {"code"') + 1
    short = RolloutConfig(max_tokens_per_turn=5)
    assert "max_tokens_per_turn 5" in str(budget_violation(ex, short))
    assert "max_trajectory_tokens 10" in str(budget_violation(ex, RolloutConfig(max_trajectory_tokens=10)))


def test_a_text_only_trajectory_is_the_reasoning_in_one_turn_without_the_tool(
    qwen_tokenizers: dict, fixture_data: Path, executor: Executor
) -> None:
    protocol = _protocols(qwen_tokenizers, fixture_data)["hermes"]
    row = _train_rows(fixture_data, 1)[0]  # Natalia
    problem = Problem("natalia", row["question"], "72")
    with pytest.raises(ValueError, match="without the tool"):
        convert_solution(problem, row["answer"], protocol, caching_observer(executor), text_only=True)
    text = protocol.with_tools(False)
    ex = convert_solution(problem, row["answer"], text, caching_observer(executor), text_only=True)
    assert ex.style == "annotated_text" and len(assistant_spans(ex.weights)) == 1
    reply = text.decode(_spans(ex.tokens, ex.weights)[0])
    assert "48/2 = 24 clips in May" in reply and "<<" not in reply and reply.count("\\boxed{72}") == 1
    assert "code_interpreter" not in ex.text and '"arguments"' not in ex.text  # no tool offered or called
    messages = [
        *text.initial_messages(problem.question),
        text.assistant_message(reply[: -len(text.decode([text.end_of_turn_id]))]),
    ]
    full = text.encode(text.render(messages, add_generation_prompt=False))
    assert ex.tokens == full[: len(ex.tokens)]
    # The arithmetic is still executed and checked: a wrong annotation drops the row either way.
    wrong = row["answer"].replace("<<48/2=24>>", "<<48/2=25>>")
    with pytest.raises(Dropped) as err:
        convert_solution(problem, wrong, text, caching_observer(executor), text_only=True)
    assert err.value.reason == "observation_mismatch"
