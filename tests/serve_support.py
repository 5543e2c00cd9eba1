"""What ``retool serve`` supports, per SDK, as the tests that show it: the source of docs/serve.md's "SDK call"
table. ``scripts/serve_support_table.py`` runs these tests and writes the table from their outcome (a cell
is "yes" only when every test it names passed); ``tests/test_serve_support_table.py`` checks that every
named test exists and that that page's table is this one.

A cell is a tuple of test ids (``file::function``), ``None`` (not that SDK's feature: "—"), or a string
written as is (a feature refused on purpose, or not tested: said so)."""

from __future__ import annotations

Cell = tuple[str, ...] | str | None

S = "test_serve.py::"
L = "test_serve_losses.py::"
M = "test_serve_multi_lora.py::"

CHAPTER = S + "test_chapter_shaped_pytrio_training_and_evaluation_scripts_run_unmodified"
PY_RESUME = S + "test_pytrio_state_resumes_into_a_new_client_with_identical_logprobs"
TK_TRAIN = S + "test_tinker_sdk_trains_samples_saves_and_resumes"
TK_LOSSES = L + "test_every_tinker_loss_reports_its_documented_formula"
TK_PROVENANCE = L + "test_stable_reinforce_checks_provenance_and_gspo_its_mask"
PY_LOSSES = L + "test_pytrio_cispo_and_dro_report_the_formula_over_the_sdk_denominator"
COOKBOOK = S + "test_tinker_cookbook_math_rl_arithmetic_recipe_runs_against_the_server_with_its_default_loss"
KEYS = S + "test_an_api_key_is_required_the_way_each_sdk_sends_it"

# (SDK call, PyTRIO, Tinker, notes)
ROWS: list[tuple[str, Cell, Cell, str]] = [
    (
        "`ServiceClient()`, capabilities / supported models, sessions, heartbeats",
        (CHAPTER, KEYS),
        (TK_TRAIN, KEYS),
        "any key unless `--api-key`",
    ),
    (
        "`create_lora_training_client(base_model, rank, seed, train_mlp/attn/unembed)`",
        (CHAPTER,),
        (TK_TRAIN,),
        "attn = q/k/v/o, mlp = gate/up/down, unembed = `lm_head`; rank 1-256; nothing trainable: 400",
    ),
    ("`get_tokenizer()`", (PY_RESUME,), (TK_TRAIN,), "the model id is the local folder"),
    (
        "`forward`, `forward_backward`: `cross_entropy`, `importance_sampling`, `ppo`",
        (CHAPTER, PY_RESUME),
        (TK_TRAIN, TK_LOSSES),
        "per-token logprobs returned; Tinker's loss values against the documented formulas",
    ),
    (
        "`forward`, `forward_backward`: `cispo`, `dro`",
        (PY_LOSSES,),
        (TK_LOSSES,),
        "loss values against the documented formulas (PyTRIO: over the SDK's token counts)",
    ),
    (
        "`forward_backward`: `gspo` (with `sequence_ratio_mask`), `stable_reinforce` (with provenance)",
        None,
        (TK_LOSSES, TK_PROVENANCE, COOKBOOK),
        "`record_stability_info` sampling; unknown, foreign-session or mismatched sequences and a missing mask: 400",
    ),
    (
        "tinker-cookbook `math_rl` (arithmetic) with its defaults",
        None,
        (COOKBOOK,),
        "its default loss is `stable_reinforce`",
    ),
    (
        "`forward_backward(auto_shift=True)`",
        "yes (untested)",
        None,
        "the first label of each datum is dropped",
    ),
    (
        "`forward_backward_custom` (a Python callable)",
        "client-side, as the SDK does it (untested)",
        (L + "test_custom_losses_run_client_side_and_server_side_graphs_get_a_clear_400",),
        '`loss_fn="custom"` with an uploaded loss graph: 400',
    ),
    (
        "`optim_step(AdamParams)`",
        (CHAPTER,),
        (TK_TRAIN,),
        "every field, `grad_clip_norm` 0 = off; Tinker's other optimizers: 400",
    ),
    (
        "`save_state` / `save_weights_for_sampler` / `save_weights_and_get_sampling_client`",
        (CHAPTER, PY_RESUME),
        (TK_TRAIN,),
        "names `[A-Za-z0-9._-]`, no leading `.`; the temporary weights of `save_weights_and_get_sampling_client` "
        "are a frozen adapter copy in memory (the last 16; gone after a restart), named saves are files",
    ),
    (
        "`load_state`, `load_state_with_optimizer`, `create_training_client_from_state[_with_optimizer]`",
        (PY_RESUME,),
        (TK_TRAIN,),
        "LoRA settings must match the checkpoint",
    ),
    ("`create_sampling_client(base_model / model_path)`", (CHAPTER,), (TK_TRAIN,), ""),
    (
        "`sample` / `sample_async` (n, temperature, top_p, top_k, max_tokens, seed, stop strings or ids)",
        (CHAPTER,),
        (TK_TRAIN,),
        "tokens + logprobs (+ text for PyTRIO); EOS always stops (Tinker's `stop=[]` does not disable it)",
    ),
    (
        "prompt logprobs: `include_prompt_logprobs`, `topk_prompt_logprobs`, `compute_logprobs`",
        (L + "test_pytrio_prompt_logprobs_match_the_trainers_forward",),
        (L + "test_tinker_prompt_logprobs_topk_and_targets_match_the_trainers_forward",),
        "scored by the sampler's weights, equal to the trainer's forward; Tinker also `prompt_logprobs_last_n` "
        "and `target_prompt_logprobs` (dense or CSR)",
    ),
    (
        "many training clients on one base model",
        "yes (the same server state as Tinker's, tested there and in `test_serve_shared_base.py`)",
        (S + "test_two_tinker_training_clients_never_see_each_others_weights",),
        "one frozen base, an adapter and optimizer each; no client sees another's weights",
    ),
    (
        "sampling many clients' adapters (and the base) together",
        (M + "test_the_servers_samplers_of_two_runs_and_the_base_share_one_engine",),
        (M + "test_the_servers_samplers_of_two_runs_and_the_base_share_one_engine",),
        "one engine per base model decodes every adapter's requests in one batch (`retool.backends.samplers.multi_lora`); "
        "the same tokens as each adapter sampled alone",
    ),
    ("top-k sample logprobs, `prompt_alt_tokens_k`, images", "no", "no", "400"),
    (
        "REST: checkpoint listing / deletion / download, training-run listing, sessions search, telemetry",
        "no (telemetry accepted and dropped)",
        "no",
        "",
    ),
]

BEGIN = (
    "<!-- serve-support: generated by scripts/serve_support_table.py from the tests; do not edit by hand -->"
)
END = "<!-- /serve-support -->"


def named_tests() -> list[str]:
    """Every test the table names, once, in order."""
    out: list[str] = []
    for _, *cells, _ in ROWS:
        for cell in cells:
            if isinstance(cell, tuple):
                out += [t for t in cell if t not in out]
    return out


def render(outcome: dict[str, bool]) -> str:
    """The table, from each named test's outcome (True: passed)."""

    def show(cell: Cell) -> str:
        if cell is None:
            return "—"
        if isinstance(cell, str):
            return cell
        failed = [t.split("::")[1] for t in cell if not outcome.get(t, False)]
        return "yes" if not failed else "**failing**: " + ", ".join(f"`{f}`" for f in failed)

    lines = [BEGIN, "| SDK call | PyTRIO | Tinker | notes |", "|---|---|---|---|"]
    lines += [f"| {call} | {show(p)} | {show(t)} | {notes} |" for call, p, t, notes in ROWS]
    return "\n".join([*lines, END])
