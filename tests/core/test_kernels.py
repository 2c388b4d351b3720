"""target/kernels.py: the packed oneDNN linear computes F.linear's result, is used where it can be and nowhere else,
follows in-place changes of its weight, and leaves a target (and a head loaded for it) a plain-looking nn.Linear
model whose greedy decoding stays lossless on either kernel."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
import torch.nn.functional as F

from selfspec.target import avx2, kernels
from selfspec.core.errors import UserError
from selfspec.target.kernels import PackedLinear, linear
from selfspec.target.model import load_target
from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.heads.checkpoint import head_record, load_head, save_head
from selfspec.methods.eagle.head import build_eagle
from tolerance import assert_close, layers, terms

pytestmark = pytest.mark.skipif(not kernels.available(), reason="this torch has no oneDNN")


def _packed_of(w, kind="onednn"):
    entry = kernels._PACKED.get((id(w), kind))
    return None if entry is None or entry[0]() is not w else entry[2]


@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (8, 48), (2, 5, 48)])
def test_packed_linear_is_f_linear(shape):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 48), torch.randn(96), torch.randn(*shape)
    with torch.no_grad():
        got = linear(x, w, b)
    assert _packed_of(w) is not None  # the packed path ran, not the fallback
    assert_close(got, F.linear(x, w, b), k=48 + 1, scale=terms(x, w, b))  # the bias is one more term


def test_packed_from_rows_sends_fewer_rows_to_f_linear():
    torch.manual_seed(0)
    w, x1, x2 = torch.randn(96, 48), torch.randn(1, 1, 48), torch.randn(1, 2, 48)
    with torch.no_grad():
        assert torch.equal(linear(x1, w, packed_from=2), F.linear(x1, w))  # sgemm itself, bit for bit
        assert _packed_of(w) is None
        got = linear(x2, w, packed_from=2)
    assert _packed_of(w) is not None
    assert_close(got, F.linear(x2, w), k=48, scale=terms(x2, w))


def test_falls_back_where_it_cannot_serve():
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    x = torch.randn(4, 16, requires_grad=True)
    y = linear(x, w)  # autograd: F.linear, which has a backward
    y.sum().backward()
    assert_close(x.grad, w.sum(0).expand(4, 16), k=32, scale=float(w.abs().sum(0).max()))  # a GEMM against a sum
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w).dtype == torch.bfloat16  # autocast's cast, which the packed fp32 path would skip
    with torch.no_grad():
        assert linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    assert _packed_of(w) is None
    old = torch.backends.mkldnn.matmul.fp32_precision
    try:  # a user letting oneDNN round fp32 to bf16: the packed path would no longer be fp32
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        with torch.no_grad():
            linear(x, w)
        assert _packed_of(w) is None
        torch.set_float32_matmul_precision("medium")  # the older API says the same to oneDNN
        with torch.no_grad():
            linear(x, w)
        assert _packed_of(w) is None
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.backends.mkldnn.matmul.fp32_precision = old


def test_an_in_place_change_of_the_weight_is_seen():
    torch.manual_seed(0)
    w, x = torch.randn(32, 16), torch.randn(2, 16)
    with torch.no_grad():
        linear(x, w)
        w.mul_(2.0)  # a stale packed copy would still give the old product
        assert_close(linear(x, w), F.linear(x, w), k=16, scale=terms(x, w))
    with torch.inference_mode():  # inference tensors keep no version count: packed once, still right
        rows = torch.randn(8, 16)
        assert_close(linear(x, rows), F.linear(x, rows), k=16, scale=terms(x, rows))


def test_a_weight_that_dies_after_the_module_is_torn_down_leaves_quietly(monkeypatch):
    """Interpreter shutdown sets a module's globals to None before the last weights die: their packed copies'
    weakref callbacks then printed "Exception ignored ..." tracebacks under a command's output."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    w = torch.randn(32, 16)
    linear(torch.randn(2, 16), w)
    key, cache = (id(w), "onednn"), kernels._PACKED
    assert key in cache
    monkeypatch.setattr(kernels, "_PACKED", None)  # what shutdown leaves
    del w
    gc.collect()
    assert not seen, seen[0].exc_value
    assert key not in cache  # and the copy went with its weight


def test_target_linears_are_packed_and_look_the_same():
    packed = load_target("tiny:llama", seed=4, kernels="packed")
    plain = load_target("tiny:llama", seed=4, kernels="default")
    mixed = load_target("tiny:llama", seed=4, kernels="mixed")
    mixed4 = load_target("tiny:llama", seed=4, kernels="mixed:4")
    assert (packed.kernels, plain.kernels, mixed.kernels, mixed4.kernels) == ("packed", "default", "mixed", "mixed:4")
    n = sum(type(m) is PackedLinear for m in packed.model.modules())
    assert n == 2 * 7 + 1  # q k v o gate up down per layer, and the lm_head
    assert {m.packed_from for m in packed.model.modules() if type(m) is PackedLinear} == {1}
    assert {m.packed_from for m in mixed.model.modules() if type(m) is PackedLinear} == {2}
    assert {m.packed_from for m in mixed4.model.modules() if type(m) is PackedLinear} == {4}
    assert sum(type(m) is PackedLinear for m in mixed.model.modules()) == n
    assert not any(type(m) is PackedLinear for m in plain.model.modules())
    assert all(isinstance(m, torch.nn.Linear) for m in packed.model.modules() if type(m) is PackedLinear)
    assert packed.model.state_dict().keys() == plain.model.state_dict().keys()
    assert packed.identity == plain.identity
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        a, b = packed.model(ids).logits, plain.model(ids).logits
    assert_close(a, b, **layers(packed.model.config, 2, positions=12, ops=2))  # and the final norm, the lm_head
    assert _packed_of(packed.model.model.layers[0].mlp.up_proj.weight) is not None
    with torch.no_grad():  # mixed: sgemm for a plain step's one row, the packed kernel for a pass over more
        assert torch.equal(mixed.model(ids[:, :1]).logits, plain.model(ids[:, :1]).logits)
        assert _packed_of(mixed.model.model.layers[0].mlp.up_proj.weight) is None
        assert_close(mixed.model(ids).logits, a, **layers(packed.model.config, 2, positions=12, ops=2))
    assert _packed_of(mixed.model.model.layers[0].mlp.up_proj.weight) is not None
    with torch.no_grad():  # mixed:4: sgemm up to three rows
        assert torch.equal(mixed4.model(ids[:, :3]).logits, plain.model(ids[:, :3]).logits)
        assert _packed_of(mixed4.model.model.layers[0].mlp.up_proj.weight) is None
        assert_close(mixed4.model(ids[:, :4]).logits, a[:, :4], **layers(packed.model.config, 2, positions=4, ops=2))
    assert _packed_of(mixed4.model.model.layers[0].mlp.up_proj.weight) is not None


def test_bad_kernels_choice_is_one_line_and_checked_first():
    with pytest.raises(UserError, match="unknown target.kernels 'fast'"):
        load_target("/nonexistent/folder", kernels="fast")  # before the (missing) folder is read
    with pytest.raises(UserError, match="kernels=packed needs an fp32 target"):
        load_target("tiny:llama", dtype="bfloat16", kernels="packed")
    with pytest.raises(UserError, match="kernels=mixed needs an fp32 target"):
        load_target("tiny:llama", dtype="bfloat16", kernels="mixed")
    for bad in ("mixed:0", "mixed:x", "mixed:", "mixed:04", "mixed:2000", "mixed:\u00b2", "packed:2"):
        with pytest.raises(UserError, match=f"unknown target.kernels '{bad}'"):
            load_target("/nonexistent/folder", kernels=bad)
    t = load_target("tiny:llama", dtype="bfloat16")  # auto: nothing to pack, nothing changed
    assert not any(type(m) is PackedLinear for m in t.model.modules()) and t.kernels == "default"


def test_auto_takes_the_kernels_measured_faster_here():
    """Hosts differ (an AMX Xeon ran the packed kernel at half sgemm's rate for one row, another lost at one row and
    won at eight, and tied at two to four): auto measures both once per process at 1, 2, 4 and 8 rows and takes the
    row count from which the packed kernel costs the least over them."""
    assert kernels.faster({"default": {1: 16.3, 8: 27.4}, "packed": {1: 32.2, 8: 30.6}}) == "default"  # a Xeon
    assert kernels.faster({"default": {1: 46.0, 8: 47.0}, "packed": {1: 25.0, 8: 31.0}}) == "packed"  # the EPYC
    assert kernels.faster({"default": {1: 10.1, 8: 19.4}, "packed": {1: 13.6, 8: 15.0}}) == "mixed:8"  # another Xeon
    skinny = {"default": {1: 10.0, 2: 9.7, 4: 11.7, 8: 15.8}, "packed": {1: 11.9, 2: 11.2, 4: 12.5, 8: 14.7}}
    assert kernels.faster(skinny) == "mixed:8"  # the same Xeon, 2026-12-03: sgemm up to four rows
    skinny["packed"][4] = 11.0
    assert kernels.faster(skinny) == "mixed:4"
    skinny["packed"][2] = 9.0
    assert kernels.faster(skinny) == "mixed:2"
    skinny["packed"][4] = 12.0  # wins 2 and 8 rows, not 4: 9 + 12 + 14.7 against 36.1
    assert kernels.faster(skinny) == "mixed:2"
    # our AVX2 kernel where it costs less over the four than the best mix of the others (45.7 here), else that mix
    assert kernels.faster({**skinny, "avx2": {1: 4.2, 2: 4.7, 4: 5.3, 8: 6.5}}) == "avx2"  # an AVX2 EPYC, 2026-12-04
    assert kernels.faster({**skinny, "avx2": {1: 10.0, 2: 9.0, 4: 12.0, 8: 14.7}}) == "mixed:2"  # a tie: the libraries
    assert kernels.faster({"default": {1: 2.0, 8: 3.0}, "avx2": {1: 1.0, 8: 3.5}}) == "avx2"  # no oneDNN
    assert kernels.faster({"default": {1: 2.0, 8: 3.0}, "avx2": {1: 2.0, 8: 3.5}}) == "default"
    assert kernels.faster({"default": {1: 2.0, 8: 1.0}, "packed": {1: 1.0, 8: 3.0}}) == "default"  # by the sum
    assert kernels.faster({"default": {1: 2.0, 8: 1.0}, "packed": {1: 1.0, 8: 2.0}}) == "default"  # a tie: as is
    assert kernels.faster({"default": {1: 2.0, 8: 3.0}, "packed": {1: 1.0, 8: 3.5}}) == "packed"
    ms = kernels.measured()
    assert kernels.measured() is ms  # once per process
    assert set(ms) == {"default", "packed"} | ({"avx2"} if avx2.available() else set())
    assert all(set(v) == set(kernels.ROWS) and min(v.values()) > 0 for v in ms.values())
    t = load_target("tiny:llama")
    assert t.kernels == kernels.faster(ms)
    assert any(type(m) is PackedLinear for m in t.model.modules()) == (t.kernels != "default")


@pytest.mark.parametrize("choice", ["packed", "default", "mixed", "mixed:4", "avx2"])
def test_greedy_lossless_and_loaded_heads_follow_the_target(choice, tmp_path):
    if choice == "avx2" and not avx2.available():
        pytest.skip(f"no avx2 kernel here: {avx2.reason()}")
    target = load_target("tiny:llama", kernels=choice)
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=40, draft_vocab=torch.randperm(256)[:40]).eval()
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    loaded = load_head(str(tmp_path / "head"), target)
    assert any(type(m) is PackedLinear for m in loaded.modules()) == (choice != "default")
    rows = {"packed": 1, "default": 1, "mixed": 2, "mixed:4": 4, "avx2": 1}[choice]  # default: a plain Linear
    kind = "avx2" if choice == "avx2" else "onednn"
    assert {(m.packed_from, m.kind) for m in loaded.modules() if type(m) is PackedLinear} <= {(rows, kind)}
    assert kernels.packed_from(target.model.get_output_embeddings()) == rows
    assert kernels.kind(target.model.get_output_embeddings()) == kind
    prompt = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        want = target.model.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)[0, 20:].tolist()
    for drafter in (build_drafter("eagle", target, head=loaded, num_draft=4),
                    build_drafter("eagle", target, head=loaded, chain=False, tree_depth=3, tree_top_k=3,
                                  tree_total_tokens=10)):
        r = generate(target, drafter, prompt, 40, eos_token_ids=[])
        assert r.tokens == want
