"""The target's linear layers on a CPU: oneDNN with each weight packed once, instead of MKL's sgemm.

A decoding step of a small target on a CPU is its linear layers reading their weights. MKL's fp32 sgemm (what
`nn.Linear` calls) over a few rows costs up to twice its one-row cost, so verifying 2-8 drafted tokens cost 1.2-1.9x
a plain step (1.2-1.6x on an AVX-512 EPYC, 1.5-1.9x on an AVX2-only one) and a drafter needed tau ~1.2-1.8 to break
even. oneDNN's inner product with a weight reordered once into its blocked layout (`mkldnn._reorder_linear_weight`,
what inductor's CPU freezing emits) reads the weights at about twice sgemm's rate for one row and stays near that
cost up to ~8 rows. SmolLM2-135M's 210 decoder linears, fp32, 2 threads of an AMD EPYC with AVX-512
(docs/history.md):

    rows        1     2     3     4     6     8    16   1024
    sgemm ms   46    58    65    51    46    47    53   1753
    packed ms  25    27    24    24    22    31    31   1236

`linear` is the one place this choice is made: `PackedLinear` (an `nn.Linear` whose forward calls it; peft and
`isinstance` see a Linear) and `decode.argmax`'s fp32 screen of the lm_head both go through it. It packs a weight on
first use and keeps the packed copy while the weight tensor lives and neither its values nor its storage change
(`_state`), at the cost of a second copy of each packed weight's memory. Anything it cannot serve (a GPU, another
dtype, autograd, autocast) goes to `F.linear` unchanged. The packed path is fp32 throughout (oneDNN's default fp32
math mode): it rounds differently from sgemm in the last bits, as any other GEMM shape or library does, which greedy
verification's exactness does not depend on (decode/argmax.py).

Hosts differ: on an Intel Xeon with AMX (2026-12-01) the packed kernel ran the same linears at half sgemm's rate for
one row and slower up to 8 rows (one row 32.2 ms against 16.3, 8 rows 30.6 against 27.4); on another (2026-12-02) it
lost at one row and won at 8 (one row 13.6 ms against 10.1, 8 rows 15.0 against 19.4), where packing every linear
made plain decoding 25 % slower than sgemm's (13 tok/s against 17.5) for a faster verification pass; there sgemm
still matched it at 2-4 rows, the passes a suffix drafter's 2-3 token drafts make. So `auto` measures both once per
process (`measured`: F.linear and the packed kernel over weights too large for the caches, at 1, 2, 4 and 8 rows) and
takes the row count from which the packed kernel runs that costs the least over those four (`faster`): `packed` (from
one row), `default` (never), or `mixed:k` (sgemm below k rows, the packed kernel from k up; `mixed` is `mixed:2`).
Each, named, is taken without measuring. `avx2` (2026-12-04): target/avx2.py's own kernel, which on an AVX2 EPYC
read the weights at 1.5-1.8x oneDNN's rate at 1-8 rows; `auto` measures it beside the two libraries where it builds.
"""

from __future__ import annotations

import functools
import re
import sys
import time
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from selfspec.core.errors import UserError
from selfspec.target import avx2

KERNELS = ("auto", "packed", "default", "mixed", "mixed:k", "avx2")  # k: the rows from which mixed takes oneDNN
_PACKED: dict[tuple, tuple] = {}  # (id(weight), kind) -> (weakref to it, its _state when packed, the packed copy)
ROWS = (1, 2, 4, 8)  # what auto measures: a plain step's one row, a suffix draft's pass, a head's chain or tree
WEIGHTS = (40, 1536, 576)  # ... over this many [N, K] fp32 weights (141 MB: beyond a CPU's caches, as a target is)


def check(kernels: str) -> None:
    if kernels in ("auto", "default", "avx2"):
        return
    if _packed_from(kernels) is None:
        raise UserError(f"unknown target.kernels '{kernels}'; use one of {list(KERNELS)} (k: rows, 1 to 1024)")


def _packed_from(kernels: str) -> Optional[int]:
    """The rows from which `kernels` (packed, mixed or mixed:k) takes the packed kernel; None for anything else."""
    if kernels == "packed":
        return 1
    name, colon, k = kernels.partition(":")
    if name != "mixed":
        return None
    if not colon:
        return 2
    return int(k) if re.fullmatch(r"[1-9][0-9]{0,3}", k) and int(k) <= 1024 else None


@functools.cache
def available() -> bool:
    """This torch can run oneDNN's packed fp32 inner product on this CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _ieee_fp32() -> bool:
    """oneDNN computes fp32 as fp32: no user setting lets it round fp32 inputs to bf16 or tf32, which
    `torch.set_float32_matmul_precision` or `torch.backends.mkldnn.matmul.fp32_precision` can ask of it (MKL's sgemm,
    the fallback, stays fp32 whatever they say; decode/argmax.py's bounds assume fp32)."""
    return getattr(torch.backends.mkldnn.matmul, "fp32_precision", "none") in ("none", "ieee")  # both set it


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, packed_from: int = 1,
           kind: str = "onednn") -> torch.Tensor:
    """F.linear(x, w, b), through a packed kernel where it applies: x [..., K], w [N, K] -> [..., N]. kind "onednn":
    oneDNN's where x has at least `packed_from` rows; "avx2": target/avx2.py's where x has at most avx2.MAX_ROWS."""
    if kind == "avx2":
        if not (_avx2_fits(x, w, b) and avx2.available()):
            return F.linear(x, w, b)
        return avx2.linear(x, _packed(w, kind, avx2.pack), w.shape[0], b)
    if not (_fits(x, w, b) and available() and _ieee_fp32()) or x.numel() // x.shape[-1] < packed_from:
        return F.linear(x, w, b)
    y = _packed_linear(x.reshape(-1, x.shape[-1]), _packed(w, kind, torch.ops.mkldnn._reorder_linear_weight), b)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _packed(w: torch.Tensor, kind: str, pack) -> torch.Tensor:
    """`w` packed for `kind` by `pack`, once while w lives and neither its values nor its storage change."""
    key = (id(w), kind)
    entry = _PACKED.get(key)
    if not _current(entry, w):
        # the callback holds the dict itself: at interpreter exit the module's globals may be gone before w
        entry = (weakref.ref(w, lambda _, cache=_PACKED: cache.pop(key, None)), _state(w), pack(w.detach()))
        _PACKED[key] = entry
    return entry[2]


def _current(entry: Optional[tuple], w: torch.Tensor) -> bool:
    """A _PACKED entry is w's packed copy as w is now: packed from w itself, with w's _state unchanged since."""
    return entry is not None and entry[0]() is w and entry[1] == _state(w)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """oneDNN's inner product: x [M, K] and a weight reordered by `_reorder_linear_weight` -> [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def _state(w: torch.Tensor) -> tuple[int, int]:
    """What a packed copy of `w` depends on: its in-place version and its storage (`w.data = t` keeps the version)."""
    return _version(w), w.data_ptr()


def _version(w: torch.Tensor) -> int:
    """How often `w` was modified in place; -1 for an inference tensor, which keeps no count: one made under
    torch.inference_mode (a head's draft-vocabulary rows of the lm_head) must not be modified after it is packed."""
    try:
        return w._version
    except RuntimeError:
        return -1


def _fits(x, w, b) -> bool:
    """fp32 on a CPU, with neither autograd nor autocast to honour: what either packed kernel serves."""
    return (x.dtype is torch.float32 and w.dtype is torch.float32 and x.is_cpu and w.is_cpu
            and (b is None or b.dtype is torch.float32) and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.is_autocast_enabled("cpu"))


def _avx2_fits(x, w, b) -> bool:
    """What the avx2 kernel serves: `_fits`, an input as wide as w (the kernel would read past a narrower one's
    packed weight), at most avx2.MAX_ROWS rows. `linear` and PackedLinear's lean path both ask this."""
    return (_fits(x, w, b) and x.shape[-1] == w.shape[-1]
            and x.numel() <= avx2.MAX_ROWS * x.shape[-1])


class PackedLinear(torch.nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose forward goes through `linear` with its `kind`, packed
    from `packed_from` rows (`use` sets both per module: 1 for packed and avx2, k for mixed:k)."""

    packed_from: int = 1
    kind: str = "onednn"
    _served: Optional[tuple] = None  # avx2: the _PACKED entry `linear` last served this module's weight from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`linear`; on avx2, once it has packed this weight, the kernel straight away while the weight is the one
        packed and `_avx2_fits` holds (what `linear` asks), without `linear`'s lookup of the packed copy."""
        w, b, served = self.weight, self.bias, self._served
        if _current(served, w) and _avx2_fits(x, w, b):
            return avx2.linear(x, served[2], self.out_features, b)
        y = linear(x, w, b, self.packed_from, self.kind)
        if self.kind == "avx2":
            self._served = _PACKED.get((id(w), "avx2"))
        return y


def packed_from(module: torch.nn.Module) -> int:
    """The rows from which `module` (a target's lm_head, say) takes the packed kernel: what a head's own `linear`
    over its rows passes, so that it runs as the target's linears do (1 for a plain nn.Linear, `linear`'s default)."""
    return getattr(module, "packed_from", 1)


def kind(module: torch.nn.Module) -> str:
    """The packed kernel `module` takes (`linear`'s kind), for a head's own product over its rows of it."""
    return getattr(module, "kind", "onednn")


def resolve(model: torch.nn.Module, kernels: str = "auto") -> str:
    """The kernels `model`'s linears take: avx2, packed, default or mixed:k. auto: where the model is fp32 on a CPU,
    what measured fastest on this host (`faster(measured())`), else default; avx2, packed or mixed[:k]: a one-line
    error where it cannot apply."""
    check(kernels)
    if kernels == "default":
        return "default"
    p = next(model.parameters(), None)
    fp32_cpu = p is not None and p.device.type == "cpu" and p.dtype == torch.float32
    if kernels == "avx2":
        if not (fp32_cpu and avx2.available()):
            raise UserError("target.kernels=avx2 needs an fp32 target on a CPU with AVX2 and a C++ compiler"
                            + (f" ({avx2.reason()})" if fp32_cpu else "") + "; use target.kernels=auto or default")
        return kernels
    if not (fp32_cpu and (available() or (kernels == "auto" and avx2.available()))):
        if kernels != "auto":
            raise UserError(f"target.kernels={kernels} needs an fp32 target on a CPU with oneDNN "
                            "(torch.backends.mkldnn); use target.kernels=auto or default")
        return "default"
    return kernels if kernels != "auto" else faster(measured())


def faster(ms: dict[str, dict[int, float]]) -> str:
    """The kernels to take from their times at ROWS ({"default"|"packed"|"avx2": {rows: ms}}, those measured): avx2
    where it costs less summed over ROWS than any mix of the others, else the row count k from which the packed kernel
    runs (sgemm below it) that costs the least summed over ROWS, k one of ROWS or never: packed for k = 1, default
    for never, mixed:k between. A tie goes to the larger k (the fewer rows off sgemm), and to the libraries."""
    rows = sorted(ms["default"])

    def cost(k: float) -> float:
        return sum(ms["packed" if r >= k else "default"][r] for r in rows)

    ks = [float("inf"), *reversed(rows)] if "packed" in ms else [float("inf")]
    k = min(ks, key=cost)  # min keeps the first of equals: the larger k
    if "avx2" in ms and sum(ms["avx2"][r] for r in rows) < cost(k):
        return "avx2"
    return "default" if k == float("inf") else "packed" if k == 1 else f"mixed:{k}"


@functools.cache
def measured() -> dict[str, dict[int, float]]:
    """Milliseconds of F.linear (default), of oneDNN's packed kernel (packed, where torch has it) and of
    target/avx2.py's (avx2, where it builds) over WEIGHTS at each of ROWS (the best of 5 passes after one), once per
    process; prints them with the choice, one line on stderr."""
    n, out_f, in_f = WEIGHTS
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(out_f, in_f, generator=g) for _ in range(n)]
    with torch.inference_mode():
        xs = {rows: torch.randn(rows, in_f, generator=g) for rows in ROWS}
        calls = {"default": lambda x: [F.linear(x, w) for w in ws]}
        if available():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
            calls["packed"] = lambda x: [_packed_linear(x, w) for w in packed]
        if avx2.available():
            blocked = [avx2.pack(w) for w in ws]
            calls["avx2"] = lambda x: [avx2.linear(x, w, out_f) for w in blocked]
        best = {(name, rows): float("inf") for name in calls for rows in ROWS}
        for i in range(6):  # every kernel and row count in turn, so that a load that comes and goes weighs on all alike
            for rows in ROWS:
                for name, call in calls.items():
                    t = time.perf_counter()
                    call(xs[rows])
                    if i:
                        best[name, rows] = min(best[name, rows], time.perf_counter() - t)
    ms: dict[str, dict[int, float]] = {name: {} for name in calls}
    for (name, rows), seconds in best.items():
        ms[name][rows] = round(seconds * 1e3, 2)
    figures = "; ".join(f"{name} " + ", ".join(f"{r} row{'s' * (r > 1)} {v:.1f} ms" for r, v in ms[name].items())
                        for name in ms)
    missing = "" if "avx2" in ms else f" (avx2: {avx2.reason()})"
    print(f"[kernels] fp32 linears on this CPU ({n} weights [{out_f} x {in_f}]): {figures}{missing}; "
          f"target.kernels=auto takes {faster(ms)}", file=sys.stderr, flush=True)
    return ms


def use(model: torch.nn.Module, kernels: str = "auto") -> int:
    """Route every nn.Linear of `model` (a frozen target) through `linear` where `resolve` says avx2, packed or
    mixed:k; returns how many. kernels: auto, avx2, packed, mixed[:k] or default (PyTorch's nn.Linear, unchanged)."""
    kernels = resolve(model, kernels)
    if kernels == "default":
        return 0
    rows, kind = (1, "avx2") if kernels == "avx2" else (_packed_from(kernels), "onednn")
    n = 0
    for module in list(model.modules()):
        if type(module) is torch.nn.Linear:  # exactly: subclasses (peft's, quantized ones) keep their own forward
            module.__class__ = PackedLinear
            module.packed_from, module.kind = rows, kind
            n += 1
    return n
