"""selfspec.decode.argmax.ScreenedArgmax returns exactly the fp32 argmax (first index on ties) of the lm_head's logits,
also when the top rows are closer than bf16 can tell apart, with a bias and with logit softcapping; through both of
its screens (bf16, and oneDNN fp32 for several positions at once)."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

from selfspec.decode.argmax import ScreenedArgmax


def _lm_head(V, H, bias=False, seed=0):
    torch.manual_seed(seed)
    lm = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        lm.weight.normal_(0, 0.05)
        if bias:
            lm.bias.normal_(0, 1.0)
    return lm


class _Target(torch.nn.Module):
    """What ScreenedArgmax reads of a *ForCausalLM: its lm_head and its config's softcap."""

    def __init__(self, lm, cap=None):
        super().__init__()
        self.lm, self.config = lm, PretrainedConfig(final_logit_softcapping=cap)

    def get_output_embeddings(self):
        return self.lm


# fp32_from: every call through the bf16 screen, or every call through the oneDNN fp32 one
SCREENS = {"bf16": 10**9, "fp32": 1}
screens = pytest.mark.parametrize("screen", SCREENS)


def _screened(lm, screen, cap=None):
    return ScreenedArgmax(_Target(lm, cap), fp32_from=SCREENS[screen])


def _reference(lm, h, cap=None):
    z = lm(h)
    return (torch.tanh(z / cap) * cap if cap else z).argmax(-1)


@screens
@pytest.mark.parametrize("bias,cap", [(False, None), (True, None), (False, 30.0)])
def test_random_logits(bias, cap, screen):
    lm = _lm_head(3000, 96, bias)
    h = torch.randn(64, 7, 96) * 3
    assert torch.equal(_screened(lm, screen, cap)(h), _reference(lm, h, cap))


@screens
def test_near_ties_below_bf16_resolution(screen):
    """Rows made to differ from the top row by ~1e-4 relative (bf16 resolves ~4e-3): the screen must keep them all
    and the fp32 recheck pick the top one, every time. "The top one" up to fp32 summation order: the same fp32
    logits computed for a batch of positions or for one position (or for all rows or a few) can differ in the last
    bits, so two rows within ~1e-7 of each other may swap; any row farther than that below the top is an error."""
    V, H = 2000, 64
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        lm = _lm_head(V, H, seed=trial)
        h = torch.randn(5, H, generator=g)
        with torch.no_grad():
            top = h[0] / h[0].norm() * 2.0
            rows = torch.randperm(V, generator=g)[:6]
            for r in rows:
                lm.weight[r] = top * (1 + 1e-4 * torch.randn((), generator=g)) + 1e-4 * torch.randn(H, generator=g)
        got = _screened(lm, screen)(h)
        z = lm(h)
        noise = 1e-6 * h.norm(dim=-1) * lm.weight.norm(dim=1).max()  # fp32 rounding level; bf16's is ~4e-3
        picked = z.gather(1, got[:, None])[:, 0]
        assert (picked >= z.max(-1).values - noise).all(), trial


@screens
def test_exact_ties_take_the_first_index(screen):
    lm = _lm_head(500, 32)
    with torch.no_grad():
        lm.weight[400] = lm.weight[123] = torch.ones(32)
    h = torch.ones(2, 32)
    assert _screened(lm, screen)(h).tolist() == [123, 123] == _reference(lm, h).tolist()


def test_the_fp32_screen_keeps_every_row_within_its_bound():
    """Its bound is what makes it exact: rows a few fp32 ulps apart stay candidates (a bound of 0 loses some)."""
    V, H = 4000, 128
    lm = _lm_head(V, H, bias=True)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, H, generator=g)
    with torch.no_grad():  # row 0 wins position 0; rows 1-40 equal it up to a few ulps of their logits
        lm.bias[:41] = 0.0
        lm.weight[0] = h[0] / h[0].norm() * 3.0
        lm.weight[1:41] = lm.weight[0] * (1 + 2.0**-22 * torch.randn(40, 1, generator=g))
    s = _screened(lm, "fp32")
    z, bound = s._screen(h)
    exact = lm(h)
    assert ((z - exact).abs() <= bound).all()
    floor = (z - bound).amax(-1, keepdim=True)
    alive = (z + bound >= floor)[0]
    assert alive[:41].sum() > 1  # the near-tied rows are all still in the running
    assert torch.equal(s(h), _reference(lm, h))


def test_not_screened_off_cpu_fp32():
    lm = _lm_head(300, 32).to(torch.bfloat16)
    s = ScreenedArgmax(_Target(lm), fp32_from=1)
    h = torch.randn(4, 32, dtype=torch.bfloat16)
    assert not s.screen and torch.equal(s(h), lm(h).argmax(-1))
