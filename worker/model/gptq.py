"""GPTQ for a looped model: Hessians of each projection's inputs, then column-by-column
quantization with error feedback (Frantar et al., 2022), groups of quant.py's format.

The shared block's weights see one input per iteration, and its rounding error is paid at
every one of them, so its Hessian H = sum x x^T runs over every iteration the calibration
pass runs (`calib_loops`), not over the first: a `Recorder` stands in for each weight during
the calibration forward and the same recorder is called L times a token.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tinyloop.worker.model.quant import QMAX, group_params, pack4, pack_sign, sign_channel

DAMP = 0.01  # the Hessian's diagonal damping, a share of its mean diagonal (GPTQ's default)


class Recorder:
    """A weight that adds x^T x of every input to its Hessian, then multiplies as the weight
    does (modules.linear takes it in the weight's place)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.hessian = torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float64)
        self.rows = 0

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).double()
        self.hessian += flat.t() @ flat
        self.rows += flat.shape[0]
        return F.linear(x, self.weight)


@torch.no_grad()
def hessians(model, windows: torch.Tensor, loops: int, prefixes: list[str],
             progress: Callable = lambda it: it, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """{prefix: H (K, K) fp64, the mean of x x^T over every row the projection saw} from a
    forward of `windows` (N, T) at depth `loops`."""
    recorders = {}
    for prefix in prefixes:
        lin = model.get_submodule(prefix)
        recorders[prefix] = Recorder(lin.weight.detach())
        del lin.weight  # the Parameter gives way to a plain attribute for the pass
        lin.weight = recorders[prefix]
    try:
        for i in progress(range(0, len(windows), batch_size)):
            model(windows[i:i + batch_size], loops)
    finally:
        for prefix, r in recorders.items():
            lin = model.get_submodule(prefix)
            del lin.weight
            lin.weight = torch.nn.Parameter(r.weight, requires_grad=False)
    return {p: r.hessian / max(r.rows, 1) for p, r in recorders.items()}


@torch.no_grad()
def quantize(w: torch.Tensor, H: torch.Tensor, group_size: int, cancel_round: bool = False,
             block: int = 128) -> dict[str, torch.Tensor]:
    """GPTQ of w (N, K) with Hessian H (K, K) -> the stored tensors by suffix (quant.rtn's).
    Each group's scale and zero come from the group's weights as the error feedback has left
    them when its first column is reached; the sign channel (cancel_round) from each column's
    unrounded codes at the moment it is rounded."""
    W = w.double().clone()
    N, K = W.shape
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += DAMP * torch.mean(torch.diag(H)) * torch.eye(K, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # upper factor of H^-1

    block = max(group_size, block // group_size * group_size)  # whole groups a block
    q = torch.zeros(N, K, dtype=torch.uint8)
    d = torch.zeros(N, K, dtype=torch.int8)
    scales = torch.zeros(N, K // group_size, dtype=torch.float16)
    zeros = torch.zeros(N, K // group_size, dtype=torch.uint8)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        Wb = W[:, b0:b1].clone()
        Ub = U[b0:b1, b0:b1]
        err = torch.zeros_like(Wb)
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                s, z = group_params(Wb[:, i:i + group_size].float(), group_size)
                scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
                sf, zf = s[:, 0].double(), z[:, 0].double()
            t = Wb[:, i] / sf + zf
            qi = torch.round(t).clamp(0, QMAX)
            q[:, col] = qi.to(torch.uint8)
            if cancel_round:
                d[:, col] = sign_channel(qi[:, None], t[:, None].float())[:, 0]
            e = (Wb[:, i] - (qi - zf) * sf) / Ub[i, i]
            Wb[:, i:] -= e[:, None] * Ub[i, i:][None, :]
            err[:, i] = e
        W[:, b1:] -= err @ U[b0:b1, b1:]
    out = {"qweight": pack4(q), "scales": scales, "zeros": zeros}
    if cancel_round:
        out["sign"] = pack_sign(d)
    return out
