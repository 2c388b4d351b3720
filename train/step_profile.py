"""Where the compute of one training step goes: torch.profiler ranges per phase, the FLOPs of their matmuls, and
torch.matmul's measured peaks on the same shapes (what scripts/profile_step.py runs and prints).

The phases are the torch.profiler ranges (record_function) the recipe code marks; a phase's time excludes the phases
nested in it:

    data            iterate: rows read from the data set, collated, moved to the device (marked here)
    target forward  the frozen target's decoder (train/eagle.target_features, data/features.last_features)
    target argmax   the target's full lm_head argmax (train/features.soft_labels, data/features.full_argmax)
    memo            the feature memo's own work: copying rows in and out (train/eagle.micro_step)
    soft labels     the target's distribution over the draft vocabulary (train/features.soft_labels)
    head forward    the head's passes (train/eagle.eagle_loss, train/rollout.ttt_unroll)
    loss            head logits, log-softmax, soft CE, SmoothL1, masks, .item() (train/eagle's losses)
    backward, optimizer   train/eagle.micro_step (optimizer: clip, AdamW, zero_grad and the LR schedule's step)
    other           the step's wall time minus the phases above (the glue between them)

Times are the ranges' CPU wall time (on a GPU: the kernel time of the ops each range launched). FLOPs are read from
the shapes the profiler records: 2*batch*m*k*n per mm/addmm/bmm/baddbmm (padded rows count), attention kernels as
their Q K^T and P V matmuls (backward: 4; a causal kernel without a mask skips half the keys); elementwise work is
not counted. A phase's peak is torch.matmul's best GFLOP/s on that phase's own GEMM shapes and dtypes (measured with
torch.get_num_threads() threads), combined as the time the phase would take if every GEMM ran at its own peak:
sum(flops) / sum(flops / peak_of_shape), on the median timed batch; achieved/peak is that ideal time over the
measured time. Figures are medians over the timed steps (`per_step` keeps each step's seconds, GFLOP and loss).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict
from typing import Any, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ["data", "target forward", "target argmax", "memo", "soft labels", "head forward", "loss", "backward",
          "optimizer", "other"]
DTYPES = {"float": "float32", "double": "float64", "c10::BFloat16": "bfloat16", "c10::Half": "float16"}


FORMULAS = {
    "gemm": "2*batch*m*k*n FLOPs per mm/addmm/bmm/baddbmm ([m x k] @ [k x n]) the profiler records, shapes as run "
            "(padded rows counted); elementwise work not counted",
    "attention": "fused kernels as Q K^T and P V (backward: dV, dP, dQ, dK); a causal kernel without a mask (the "
                 "memo's unpadded single-sequence passes) counts (T+1)/(2T) of the keys",
    "peak": "sum(flops) / sum(flops / torch.matmul best GFLOP/s of each shape and dtype), median batch's shapes",
    "achieved_over_peak": "ideal time at those peaks / measured time",
}


# ------------------------------------------------------------------------------------------ the profiler's record


def profiled(it, work, device) -> tuple[float, list, dict, Any]:
    """One step under torch.profiler: the next batch (the `data` range), then work(batch). Its wall seconds, the
    profiler's events, the batch and what work returned."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        with record_function("data"):
            _, batch = next(it)
            batch = {k: v.to(device) for k, v in batch.items()}
        out = work(batch)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    return seconds, prof.events(), batch, out


def profile_pass(label: str, work, it, warmup: int, steps: int, device) -> list[dict]:
    """`warmup` untimed then `steps` timed steps of work(batch) under the profiler, each on the next batch of `it`
    (train/batching.iterate): per timed step its phases, GEMMs, seconds, tokens, shape and what work returned."""
    timed = []
    for i in range(warmup + steps):
        seconds, events, batch, out = profiled(it, work, device)
        if i >= warmup:
            timed.append({**phases_of(events, seconds, device.type == "cuda"), "seconds": seconds,
                          "tokens": int(batch["attention_mask"].sum()), "shape": list(batch["input_ids"].shape),
                          **(out if isinstance(out, dict) else {})})
        print(f"[profile] {label} {i + 1}/{warmup + steps}: {seconds * 1e3:.0f} ms", flush=True)
    return timed


def phases_of(events, seconds: float, cuda: bool) -> dict:
    """{"phases": exclusive seconds per phase range, "work": {phase: Counter[gemm]}}. An op belongs to the innermost
    phase range (any thread) holding its start; a range's own time excludes the ranges nested in it."""
    host = [e for e in events if e.device_type == DeviceType.CPU]  # (a GPU's copies of the ranges are left out)
    ranges = sorted((e for e in host if e.name in PHASES), key=lambda e: (e.time_range.start, -e.time_range.end))

    def inner(e) -> str:
        held = [r for r in ranges if r is not e and r.time_range.start <= e.time_range.start <= r.time_range.end
                and (e.name not in PHASES or e.time_range.end <= r.time_range.end)]
        return held[-1].name if held else "other"

    phases, work = defaultdict(float), defaultdict(Counter)
    for e in host:
        if e.name in PHASES:
            wall = 0.0 if cuda else e.time_range.elapsed_us() / 1e6
            phases[e.name] += wall
            phases[inner(e)] -= wall  # the range's time is its own, not its container's
        elif cuda and e.kernels:
            phases[inner(e)] += sum(k.duration for k in e.kernels) / 1e6
        for g, n in gemms(e):
            work[inner(e)][g] += n
    phases["other"] = seconds - sum(v for k, v in phases.items() if k != "other")
    return {"phases": dict(phases), "work": dict(work)}


def gemms(e) -> list[tuple[tuple, float]]:
    """The matmuls of one profiler event as ((m, k, n, batch, dtype), count) from its recorded input shapes."""
    s, name = e.input_shapes, e.name
    dtypes = getattr(e, "input_dtypes", None) or []  # torch < 2.13 records no dtypes: counted as float32

    def recorded(i: int) -> str:
        return DTYPES.get(dtypes[i] if i < len(dtypes) else "", "float32")

    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"):
        i = 1 if "add" in name else 0
        a, b = s[i], s[i + 1]
        return [((a[-2], a[-1], b[-1], a[0] if len(a) == 3 else 1, recorded(i)), 1)]
    if not name.startswith("aten::_scaled_dot_product_") or "math" in name:  # the math path runs bmm (above)
        return []
    back = name.endswith("_backward")
    q, k = s[back], s[back + 1]  # [B, heads, T, d], [B, heads, S, d] (backward: after grad_out)
    (bt, h, t, dh), keys, dtype = q, k[2], recorded(back)
    args = e.concrete_inputs or []  # is_causal follows dropout_p, the kernels' first float argument
    at = next((i + 1 for i, v in enumerate(args) if isinstance(v, float)), len(args))
    n = (t + 1) / (2 * t) if at < len(args) and args[at] is True and t == keys else 1  # causal: half the keys
    if back:  # dV = P^T dO and dK = dS^T Q; dP = dO V^T; dQ = dS K
        return [((keys, t, dh, bt * h, dtype), 2 * n), ((t, dh, keys, bt * h, dtype), n),
                ((t, keys, dh, bt * h, dtype), n)]
    return [((t, dh, keys, bt * h, dtype), n), ((t, keys, dh, bt * h, dtype), n)]  # Q K^T, P V


def flops(work: Counter) -> float:
    return sum(n * 2 * m * k * nn * b for (m, k, nn, b, _), n in work.items())


# ------------------------------------------------------------------------------------------ peaks and the table


def matmul_gflops(g: tuple, repeats: int, device) -> float:
    """torch.matmul's best GFLOP/s on shape g = (m, k, n, batch, dtype) (each timing >= ~20 ms of repeats)."""
    m, k, n, batch, dtype = g
    lead = (batch,) if batch > 1 else ()
    a = torch.randn(*lead, m, k, device=device).to(getattr(torch, dtype))
    b = torch.randn(*lead, k, n, device=device).to(getattr(torch, dtype))
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)

    def timed(reps: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        return (time.perf_counter() - t0) / reps

    timed(1)  # warm-up: first-call allocations and kernel selection
    reps = max(1, min(1000, int(0.02 / max(timed(1), 1e-7))))
    return flops(Counter({g: 1})) / min(timed(reps) for _ in range(repeats)) / 1e9


@contextlib.contextmanager
def torch_threads(n: Optional[int]):
    """torch's intra-op threads set to `n` (None: as they are) for the block, then put back: callers in the same
    process (tests) keep theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_passes(work, batches, warmup: int, steps: int, device, memo: bool) -> dict[str, list[dict]]:
    """A training step (`work`) profiled on the first batches (`batches()`: a fresh iterator of them): as in epoch 1
    (the feature memo's misses) and again as in later epochs (its hits), or once when there is no memo."""
    passes = {("epoch 1 (memo miss)" if memo else "every epoch (no memo)"):
              profile_pass("step", work, batches(), warmup, steps, device)}
    if memo:
        passes["later epochs (memo hit)"] = profile_pass("hit", work, batches(), warmup, steps, device)
    return passes


def target_alone(features, batches, warmup: int, steps: int, device) -> list[dict]:
    """The memo-miss target work (`features` of one sequence: data/features.last_features) on the same batches,
    one sequence at a time over its real tokens, as the feature memo runs it."""
    def work(b: dict) -> list:
        return [features(b["input_ids"][k:k + 1, :int(n)]) for k, n in enumerate(b["attention_mask"].sum(-1))]

    return profile_pass("target alone", work, batches(), warmup, steps, device)


def measured_report(passes: dict[str, list[dict]], totals: dict[str, list[dict]], repeats: int, device) -> dict:
    """The measured part of a report: torch.matmul's peaks (best of `repeats` timings per shape) on the GEMM shapes
    of the median batch (by tokens, of the first pass) in every pass, then each pass summarised against them and
    printed (`passes`: whole steps; `totals`: work timed alone, such as the target's)."""
    first = next(iter(passes.values()))
    mid = median_index([s["shape"][0] * s["shape"][1] for s in first])
    shapes = {g for steps in [*passes.values(), *totals.values()] for w in steps[mid]["work"].values() for g in w}
    print(f"[profile] measuring torch.matmul peaks on {len(shapes)} GEMM shapes ({torch.get_num_threads()} threads)")
    peaks = {g: matmul_gflops(g, repeats, device) for g in sorted(shapes)}
    report = {"median_batch": first[mid]["shape"], "formulas": FORMULAS, "passes": {}, "peaks": [
        {"m": g[0], "k": g[1], "n": g[2], "batch": g[3], "dtype": g[4], "gflops": round(v, 2)}
        for g, v in peaks.items()]}
    for name, steps in [*passes.items(), *totals.items()]:
        report["passes"][name] = summarise(steps, mid, peaks, whole_step=name not in totals)
        print_table(name, report["passes"][name])
    return report


def median_index(values: list[int]) -> int:
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def summarise(steps: list[dict], mid: int, peaks: dict, whole_step: bool = True) -> dict:
    """Per phase, each a median over the timed steps (robust to a step the OS interrupts): ms (and the range), share
    of its step's time, GFLOP, achieved GFLOP/s; the peak is the phase's (module docstring). `per_step` keeps the
    raw seconds and GFLOP."""
    median, names = statistics.median, [p for p in PHASES if any(p in s["phases"] or p in s["work"] for s in steps)]
    gflop = {n: [flops(s["work"].get(n, Counter())) / 1e9 for s in steps] for n in names}
    rows, phase_peak = {}, {}
    for name in names:
        secs = [s["phases"].get(name, 0.0) for s in steps]
        rows[name] = {"ms": round(1e3 * median(secs), 2), "ms_min": round(1e3 * min(secs), 2),
                      "ms_max": round(1e3 * max(secs), 2), "gflop": round(median(gflop[name]), 4),
                      "share": round(median(x / s["seconds"] for x, s in zip(secs, steps)), 4)}
        work = steps[mid]["work"].get(name)
        if work and flops(work) > 0 and min(secs) > 0:
            at_peaks = sum(flops(Counter({g: c})) / (peaks[g] * 1e9) for g, c in work.items())  # seconds
            phase_peak[name] = flops(work) / at_peaks / 1e9
            achieved = median(f / x for f, x in zip(gflop[name], secs))
            rows[name].update(achieved_gflops=round(achieved, 2), peak_gflops=round(phase_peak[name], 2),
                              ratio=round(achieved / phase_peak[name], 4))
    # the whole step: its GEMMs at their phases' peaks (ideal seconds) against its measured seconds
    step_gflop = [sum(gflop[n][i] for n in phase_peak) for i in range(len(steps))]
    ideal = [sum(gflop[n][i] / phase_peak[n] for n in phase_peak) for i in range(len(steps))]
    seconds = [s["seconds"] for s in steps]
    whole = {"ms": round(1e3 * median(seconds), 2), "ms_min": round(1e3 * min(seconds), 2),
             "ms_max": round(1e3 * max(seconds), 2), "gflop": round(median(step_gflop), 4),
             "tokens_per_s": round(median(s["tokens"] / s["seconds"] for s in steps), 1)}
    if phase_peak:
        whole.update(achieved_gflops=round(median(f / x for f, x in zip(step_gflop, seconds)), 2),
                     peak_gflops=round(sum(step_gflop) / sum(ideal), 2),
                     ratio=round(median(i / x for i, x in zip(ideal, seconds)), 4))
    whole["overhead_share"] = round(sum(rows[n]["share"] for n in rows if n not in phase_peak), 4)
    per_step = [{"seconds": round(s["seconds"], 4), "tokens": s["tokens"], "shape": s["shape"],
                 **({"loss": s["loss"]} if "loss" in s else {}),  # the recipe's own loss (its levers reach it)
                 "phases": {n: round(s["phases"].get(n, 0.0), 4) for n in names},
                 "gflop": {n: round(gflop[n][i], 4) for n in names if n in s["work"]}} for i, s in enumerate(steps)]
    return {"phases": rows, "step" if whole_step else "total": whole, "per_step": per_step}


def print_table(title: str, summary: dict) -> None:
    print(f"\n{title}")
    head = f"{'phase':<16}{'ms/step':>9}{'min-max':>15}{'share':>7}{'GFLOP':>9}{'GFLOP/s':>9}{'peak':>8}{'ach/peak':>9}"
    print(head + "\n" + "-" * len(head))
    whole_name = "step" if "step" in summary else "total"
    for name, r in [*summary["phases"].items(), (whole_name, {**summary[whole_name], "share": 1.0})]:  # medians
        if name == whole_name:
            print("-" * len(head))
        rate = (f"{r['achieved_gflops']:>9.1f}{r['peak_gflops']:>8.1f}{r['ratio']:>9.2f}" if "ratio" in r
                else f"{'-':>9}{'-':>8}{'-':>9}")
        spread = f"{r['ms_min']:.0f}-{r['ms_max']:.0f}"
        print(f"{name:<16}{r['ms']:>9.1f}{spread:>15}{r['share']:>7.1%}{r['gflop']:>9.2f}{rate}")
    w = summary[whole_name]
    print(f"{w['tokens_per_s']:.0f} tokens/s; time outside the matmul phases (data, memo, optimizer, other): "
          f"{w['overhead_share']:.1%}")
