"""The target's exact fp32 greedy token at a fraction of the fp32 lm_head's cost on CPUs with bf16 matrix units.

Greedy verification needs only argmax(h @ W.T) per position, and on a small target the fp32 lm_head is a large
part of a verification pass (SmolLM2-135M: 49152 x 576, ~1/3 of a 6-token pass here). `ScreenedArgmax` screens
every row in bf16, bounds each row's screening error rigorously, and recomputes in fp32 only the rows that could
still be the maximum; its answer is the fp32 argmax (first index on ties, as torch.argmax), not an approximation:
exactly as exact as fp32 itself, whose GEMMs of different shapes (one position or a batch, all rows or a few)
already round the last bits differently (verifying a whole draft in one pass has the same property).

The bound. With u = 2^-8 (bf16 unit roundoff), rounding h and W to bf16, accumulating the products in fp32 (CPU
bf16 GEMMs do) and rounding the result to bf16 moves logit r from its exact value by at most
(3u + 4u^2 + H 2^-24) S_r, S_r = sum_i |h_i W_ri| <= ||h|| ||W_r|| (Cauchy-Schwarz), and the fp32 reference is
itself within H 2^-24 S_r of it. So with C = 1.05 (3u + 4u^2 + 2 H 2^-24) (0.0124 for H = 576), a row whose
screened logit plus C ||h|| ||W_r|| is below another row's screened logit minus that row's bound is provably not
the fp32 argmax. Only CPU fp32 weights are screened (CUDA may reduce bf16 GEMMs in reduced precision); elsewhere,
and with screen=False, this is the plain fp32 argmax.

Several positions at once (a verification pass) are screened in fp32 through oneDNN instead (`fp32_from`;
target/kernels.py's packed linear, whose packed copy of the lm_head the target's own lm_head shares): MKL's fp32 GEMM
over a few rows costs 2-4x its one-row GEMV, a bf16 GEMM grows linearly with the rows where the CPU has no bf16
units, and oneDNN's fp32 GEMM with a pre-packed weight stays near one GEMV's cost (SmolLM2's lm_head on 2 AVX2
cores, ms at 1/2/3/4/6/8 positions: MKL fp32 10.2/23.9/37.9/24.8/24.4/23.5, bf16 3.5/6.7/9.1/12.9/18.0/24.2, oneDNN
fp32 5.2/11.7/9.9/10.6/11.0/12.6). Any fp32 dot product of length H, whatever its summation order, is within H 2^-24
S_r of the exact one (plus 2^-24 of |logit| + |bias| for adding the bias), so the fp32 screen's bound is C32 = 1.05
(2 (H + 1) 2^-24) ||h|| ||W_r|| + 2^-23 |b_r|: it keeps every row the fp32 recheck could make the maximum, usually
one.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from selfspec.target.kernels import available as kernels_available, kind as kernel_kind, linear
from selfspec.target.model import lm_logits

# The fewest positions screened in fp32, per packed kernel: oneDNN's costs about bf16's at 4 rows on a CPU without
# bf16 units; target/avx2.py's costs about bf16's at one row (SmolLM2's lm_head on a 2-vCPU AVX2 EPYC, ms at 1 / 2 /
# 3 / 4 / 8 rows: bf16 3.1 / 5.9 / 8.8 / 11.6 / 23.2, avx2 3.2 / 3.8 / 3.8 / 3.7 / 4.9, oneDNN 4.0 / 4.7 / 4.8 /
# 4.9 / 6.2), so two rows and more go to it.
FP32_FROM = {"onednn": 4, "avx2": 2}


class ScreenedArgmax:
    def __init__(self, model, screen: bool = True, max_candidates: int = 4096, fp32_from: Optional[int] = None):
        """model: the target (*ForCausalLM); its logits, softcap included, come from selfspec.target.model.lm_logits.
        fp32_from: screen this many positions or more in fp32 through the packed kernel the lm_head takes (oneDNN's
        where torch has it, or target/avx2.py's), fewer in bf16; None: FP32_FROM[that kernel]."""
        self.model = model
        lm_head = model.get_output_embeddings()
        w = lm_head.weight.detach()
        self.bias = getattr(lm_head, "bias", None)
        self.screen = screen and w.device.type == "cpu" and w.dtype == torch.float32
        if self.screen:
            self.w16 = w.to(torch.bfloat16)
            u, H = 2.0**-8, w.shape[1]
            self.row_bound = 1.05 * (3 * u + 4 * u * u + 2 * H * 2.0**-24) * w.norm(dim=1)  # [V]
            self.row_bound32 = 1.05 * 2 * (H + 1) * 2.0**-24 * w.norm(dim=1)  # [V]
            self.bias_bound = 0.0 if self.bias is None else 2.0**-23 * self.bias.detach().abs()
        self.w32 = lm_head.weight  # the parameter itself: target.kernels packs it once for this screen and the lm_head
        self.kind = kernel_kind(lm_head)
        fp32 = self.kind == "avx2" or kernels_available()  # a target on avx2 has it: `use` checked
        self.fp32_from = (FP32_FROM[self.kind] if fp32_from is None else fp32_from) if fp32 else None
        self.max_candidates = max_candidates

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (the target's final-norm hidden states) -> [...] token ids, exactly the fp32 argmax."""
        flat = h.reshape(-1, h.shape[-1])
        if not self.screen:
            return self._exact(flat, None).argmax(-1).reshape(h.shape[:-1])
        z, bound = self._screen(flat)  # [T, V] screened logits, and how far each can be from the fp32 one
        floor = (z - bound).amax(-1, keepdim=True)  # the fp32 maximum is at least this
        alive = z + bound >= floor  # rows that may still be the maximum (the floor's own row always is)
        # a position with one row alive has it as its fp32 argmax, with no recheck (most of a pass's positions)
        out = alive.to(torch.uint8).argmax(-1)  # the first row alive
        for t in (alive.sum(-1) > 1).nonzero().flatten().tolist():
            rows = alive[t].nonzero().flatten()  # ascending: first index wins ties, as in torch.argmax
            if rows.numel() > self.max_candidates:
                out[t] = self._exact(flat[t:t + 1], None).argmax(-1)[0]
            else:
                out[t] = rows[self._exact(flat[t:t + 1], rows).argmax(-1)[0]]
        return out.reshape(h.shape[:-1])

    def _screen(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norm = flat.float().norm(dim=-1, keepdim=True)
        if self.fp32_from is not None and flat.shape[0] >= self.fp32_from:
            z, bound = linear(flat, self.w32, kind=self.kind), norm * self.row_bound32 + self.bias_bound
        else:
            z, bound = F.linear(flat.to(torch.bfloat16), self.w16).float(), norm * self.row_bound
        if self.bias is not None:
            z += self.bias
        return z, bound

    def _exact(self, h: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """The target's fp32 logits of `rows` (None = all)."""
        return lm_logits(self.model, h, rows=rows)

