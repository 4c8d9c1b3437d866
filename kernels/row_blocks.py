"""Matrix products whose rows never depend on their neighbours (on the CPU).

A CPU GEMM library picks its blocking, and so its summation order, from the shape: the same
row multiplied inside a batch of 5 rows and inside a batch of 50 may differ in the last bit.
Serving merges requests into one launch and must give each request exactly what it would get
alone, so the torch reference multiplies in fixed blocks of ``ROWS`` rows (the last one padded
with zeros): every row goes through the same shape of GEMM wherever it sits. On a GPU the
products run as one GEMM (one launch; bf16 serving is compared within a tolerance there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rows per GEMM call on the CPU.
ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for x (n, in), weight (out, in); on the CPU in row blocks."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    n = x.shape[0]
    out = x.new_empty(-(-n // ROWS) * ROWS, weight.shape[0])
    block = x.new_zeros(ROWS, x.shape[1])
    for start in range(0, n, ROWS):
        rows = min(ROWS, n - start)
        block[:rows] = x[start : start + rows]
        if rows < ROWS:
            block[rows:] = 0
        torch.mm(block, weight.T, out=out[start : start + ROWS])
    result = out[:n]
    return result if bias is None else result + bias
