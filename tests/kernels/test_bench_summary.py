"""kernels.bench's summary and table (the timing itself needs a GPU): FP8 rows are compared
with the bf16 row of the same shape and M, and never with vLLM's bf16 anchors."""

from __future__ import annotations

from kernels.bench import (
    HOPPER_LABEL,
    HOPPER_PINGPONG_LABEL,
    TRITON_LABEL,
    Row,
    markdown,
    summary,
)


def _row(tokens: int, weights: str, lora_us: float) -> Row:
    return Row(
        "qwen3", "Qwen3-30B-A3B", tokens, {}, "table", 1e-3, 1e-3, 40.0, lora_us, None, 30.0,
        weights=weights,
    )  # fmt: skip


def test_fp8_rows_are_timed_against_their_bf16_twin() -> None:
    rows = [
        _row(1, "bf16", 100.0), _row(1, "fp8", 55.0),
        _row(4096, "bf16", 1000.0), _row(4096, "fp8", 700.0),
    ]  # fmt: skip
    text = summary([*rows, _row(1, "fp8 w8a8", 50.0)])
    assert "FP8 w8a8 / bf16 base+LoRA time, M = 1: 0.50–0.50 (≤ 0.6: 1/1)" in text
    assert "FP8 / bf16 base+LoRA time, M = 1: 0.55–0.55 (≤ 0.6: 1/1)" in text
    assert "FP8 / bf16 base+LoRA time, M = 4096: 0.70–0.70 (≤ 0.65: 0/1)" in text
    # vLLM's anchors (bf16, M = 1 and 4096) are compared with the bf16 rows only.
    assert "vs vLLM geometric mean: 1.10×" in text
    table = markdown(rows, "GPU", 3e12, 9e14).splitlines()
    fp8_lines = [line for line in table if "| fp8 |" in line]
    assert len(fp8_lines) == 2 and all(line.count("| - |") >= 2 for line in fp8_lines)


def test_no_fp8_rows_no_fp8_line() -> None:
    assert "FP8" not in summary([_row(1, "bf16", 100.0)])


def test_hopper_and_selected_rows_are_timed_against_the_triton_row_and_count_for_no_target() -> (
    None
):
    rows = [
        _row(4096, "bf16", 900.0), _row(4096, TRITON_LABEL, 1000.0),
        _row(4096, HOPPER_LABEL, 800.0),
    ]  # fmt: skip
    text = summary(rows)
    assert (
        "time / Triton kernels', qwen3 M = 4096: Hopper kernels base 1.00, +LoRA 0.80; "
        "as selected base 1.00, +LoRA 0.90"
    ) in text
    # With the row taking turns beside them.
    text = summary([*rows, _row(4096, HOPPER_PINGPONG_LABEL, 700.0)])
    assert (
        "Hopper kernels base 1.00, +LoRA 0.80; taking turns base 1.00, +LoRA 0.70; "
        "as selected base 1.00, +LoRA 0.90"
    ) in text
    assert "FP8" not in text
    # The targets count the bf16 row alone.
    assert "≤150% of floor, M = 1 and 4096: 0/1" in text
