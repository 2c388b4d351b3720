"""Where the compute of one EAGLE training step goes, against this machine's measured matmul peaks.

    python scripts/profile_step.py [experiment=smollm2_eagle_full] [steps=5] [output_file=...]

Builds what train/eagle.py builds (frozen target and its `features_dtype` copy, the tokenised training set, the
draft vocabulary, the head, AdamW and its schedule through train/loop.start_run, the feature memo) and runs its
micro-step on the recipe's own first batches (train/batching.iterate, epoch 0, one process), timing each phase with
perf_counter (the device synchronised at each edge):

    data            iterate: rows read from the data set, collated, moved to the device
    target forward  the frozen target's decoder (a forward hook on it, wherever it runs)
    target argmax   the target's full lm_head over its features (the argmax soft_labels needs for a reduced vocab)
    memo            the feature memo's own work: copying rows in and out (on a hit, all of the target's part)
    soft labels     the target's distribution over the draft vocabulary (lm_head rows) and its softmax
    head forward    the head's passes (every training-time-test step)
    loss            head logits over the draft vocabulary, log-softmax, soft CE, SmoothL1, masks, .item()
    backward        accelerator.backward(loss)
    optimizer       clip by value, AdamW step, zero_grad, the LR schedule's step
    other           the step's wall time minus the phases above (the glue between them)

With the memo on, the batches run twice: first as in epoch 1 (memo misses: the target runs, one sequence at a time)
and again as in later epochs (memo hits: the features come from RAM). `warmup` steps of each pass are not counted.

FLOPs are counted from the shapes (2*M*K*N per [M x K] @ [K x N]; elementwise work is not counted):
  a decoder stack over R rows (B sequences of T queries, S keys): every nn.Linear (in, out) of its layers, 2*R*in*out;
  attention per layer 2 * 2*B*heads*T*S*head_dim (Q K^T and P V; S = T/2 on average when the kernel is causal
  without a mask: the memo's unpadded single-sequence passes);
  lm_head rows 2*R*H*V (V = the full vocabulary for the argmax, the draft vocabulary for soft labels and logits);
  backward of the head: dX and dW for each trainable Linear (2x its forward; fc's dX only from the second TTT step
  on, when its input needs a gradient), 4 attention matmuls (2x forward), dX only through the frozen lm_head rows.
Padded rows count: the GEMMs run over them.

The peak of a phase is torch.matmul's best GFLOP/s on that phase's own GEMM shapes and dtype (measured here, with
torch.get_num_threads() threads), combined as the time the phase would take if every GEMM ran at its own peak:
peak = sum(flops) / sum(flops / peak_of_shape), on the shapes of the median timed batch. achieved/peak is then that
ideal time over the measured time. Every figure is a median over the timed steps (a step the OS interrupts does not
move it; the JSON keeps each step's raw seconds and GFLOP). Prints one table per pass and writes a JSON (atomically)
to `output_file`: only over a report it wrote unless overwrite=true, never over an input (core/ownership.py).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING
from torch import nn

from selfspec.core.cli import config_path, entry, save_config
from selfspec.core.ownership import Kind, check_output, config_kind, json_keys, owned_path
from selfspec.core.errors import UserError
from selfspec.core.target import TargetConfig, load_target_from_config
from selfspec.data.config import DataConfig
from selfspec.data.features import FeatureMemo, full_argmax, last_features
from selfspec.train.batching import iterate
from selfspec.train.common import TrainConfig, draft_schemas, eagle_terms, feature_model, soft_labels
from selfspec.train.loop import start_run
from selfspec.train.rollout import TTTConfig, shift, ttt_unroll


@dataclass
class ProfileStepConfig:
    """Schema of conf/profile_step.yaml: the recipe's own groups (as train/eagle.py reads them) plus the profile's."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: Any = field(default=MISSING, metadata={"help": "conf/draft/eagle.yaml, as train/eagle.py reads it"})
    train: TrainConfig = field(default_factory=TrainConfig)
    ttt: TTTConfig = field(default_factory=lambda: TTTConfig(steps=1), metadata={"help": (
        "Training-time-test steps, as train/eagle.py reads them (1 = EAGLE-1's teacher-forced loss).")})
    steps: int = field(default=5, metadata={"help": "timed steps per pass (median and spread over them)"})
    warmup: int = field(default=1, metadata={"help": "untimed steps before them, in each pass"})
    peak_repeats: int = field(default=5, metadata={"help": "torch.matmul peak: best of this many timings per shape"})
    threads: Optional[int] = field(default=None, metadata={"help": (
        "torch threads for the step and the peaks (null: torch's default, every core). The shipped recipe's "
        "cpu_2proc launch runs two processes of 1 thread each: threads=1 profiles one of them.")})
    output_file: str = field(default="outputs/profile_step/profile.json", metadata={"help": (
        "The JSON report (its config goes beside it as .config.yaml).")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing report or config there that this command did not write (never an input).")})


# ------------------------------------------------------------------------------------------ FLOPs from shapes


@dataclass(frozen=True)
class Gemm:
    """One matmul shape, [batch x] [m x k] @ [k x n], in `dtype`."""

    m: int
    k: int
    n: int
    batch: int
    dtype: str

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


@dataclass
class Stack:
    """The matmul geometry of a decoder stack: the nn.Linear shapes of its layers, and its attention."""

    linears: list[tuple[int, int]]  # (in, out) of every nn.Linear of every layer
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, layers: nn.ModuleList, config) -> "Stack":
        text = config.get_text_config()
        heads = text.num_attention_heads
        return cls([(m.in_features, m.out_features) for layer in layers for m in layer.modules()
                    if isinstance(m, nn.Linear)], len(layers), heads,
                   getattr(text, "head_dim", None) or text.hidden_size // heads)

    def forward(self, rows: int, b: int, t: int, s: int, dtype: str, causal: bool = False) -> Counter:
        work = Counter()
        for fan_in, fan_out in self.linears:
            work[Gemm(rows, fan_in, fan_out, 1, dtype)] += 1
        share = (t + 1) / (2 * t) if causal else 1.0  # a causal kernel skips the keys after each query
        work[Gemm(t, self.head_dim, s, b * self.heads, dtype)] += self.layers * share  # Q K^T
        work[Gemm(t, s, self.head_dim, b * self.heads, dtype)] += self.layers * share  # P V
        return work

    def backward(self, rows: int, b: int, t: int, s: int, dtype: str) -> Counter:
        work = Counter()
        for fan_in, fan_out in self.linears:
            work[Gemm(rows, fan_out, fan_in, 1, dtype)] += 1  # dX = dY W
            work[Gemm(fan_out, rows, fan_in, 1, dtype)] += 1  # dW = dY^T X
        bh, d = b * self.heads, self.head_dim
        work[Gemm(s, t, d, bh, dtype)] += 2 * self.layers  # dV = P^T dO, dK = dS^T Q
        work[Gemm(t, d, s, bh, dtype)] += self.layers  # dP = dO V^T
        work[Gemm(t, s, d, bh, dtype)] += self.layers  # dQ = dS K
        return work


def flops(work: Counter) -> float:
    return sum(count * g.flops for g, count in work.items())


# ------------------------------------------------------------------------------------------ timing


class Clock:
    """Seconds per phase of the current step; `watch` times every forward of a module (hooks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.now: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.now[name] += time.perf_counter() - t0

    def watch(self, module: nn.Module, name: str) -> list:
        start = []

        def pre(*_):
            self._sync()
            start.append(time.perf_counter())

        def post(*_):
            self._sync()
            self.now[name] += time.perf_counter() - start.pop()

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def take(self) -> dict[str, float]:
        out, self.now = dict(self.now), defaultdict(float)
        return out


@dataclass
class Step:
    """One timed micro-batch: wall seconds, phase seconds (exclusive), and the GEMMs of each phase."""

    seconds: float
    phases: dict[str, float]
    work: dict[str, Counter]
    tokens: int  # real (unpadded) tokens
    shape: tuple[int, int]  # [B, T] padded


PHASES = ["data", "target forward", "target argmax", "memo", "soft labels", "head forward", "loss", "backward",
          "optimizer", "other"]


# ------------------------------------------------------------------------------------------ entry point


REPORT = Kind("profile_step report", folder=False, mine=json_keys("formulas", "passes"))  # core/ownership.py


def inputs(cfg) -> list[tuple[str, object]]:
    return [("data.path", cfg.data.path), ("data.features_dir", cfg.data.features_dir)]


@entry("profile_step", ProfileStepConfig, draft_schemas())
def main(cfg) -> dict[str, Any]:
    out_file, d = Path(cfg.output_file), cfg.draft
    check_output(out_file, "output_file", REPORT, cfg.overwrite, inputs(cfg))  # before anything is loaded
    check_output(config_path(out_file), "output_file's config", config_kind(cfg), cfg.overwrite, inputs(cfg))
    for name, low in (("steps", 1), ("warmup", 0), ("peak_repeats", 1)):
        if getattr(cfg, name) < low:
            raise UserError(f"{name} must be >= {low} (got {getattr(cfg, name)})")
    if cfg.threads is not None and cfg.threads < 1:
        raise UserError(f"threads must be >= 1 or null (got {cfg.threads})")
    if d.type != "eagle":
        raise UserError(f"profile_step profiles train/eagle.py's step (draft=eagle), not draft={d.type}")
    if cfg.data.features != "online":
        raise UserError("profile_step profiles online features (data.features=online): the target runs in the step")

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)
    try:
        return _profile(cfg, out_file)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep theirs


def _profile(cfg, out_file: Path) -> dict[str, Any]:
    from accelerate import Accelerator

    from selfspec.data.tokenize import build_dataset
    from selfspec.heads.eagle import build_eagle
    from selfspec.heads.vocab import top_tokens

    tc, d = cfg.train, cfg.draft
    # ---- what train/eagle.py builds (one process; no run folder: nothing is saved)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=tc.grad_accum,
                              mixed_precision=tc.mixed_precision)
    torch.manual_seed(tc.seed)
    target = load_target_from_config(cfg.target, device=accelerator.device)
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)
    train_set = build_dataset(cfg.data, tok, "train", context=target.context).with_format(None)
    batches = cfg.warmup + cfg.steps
    if len(train_set) < batches * tc.batch_size:
        raise UserError(f"{len(train_set)} training sequences: fewer than (warmup + steps) x train.batch_size = "
                        f"{batches * tc.batch_size}; lower steps or train.batch_size")
    draft_vocab = None
    if d.vocab_size:
        eot = [i for i in [tok.eos_token_id] if i is not None]
        draft_vocab = top_tokens(((r["input_ids"], r["loss_mask"]) for r in train_set),
                                 target.identity["vocab_size"], d.vocab_size, always=eot)
    head = build_eagle(target.model, num_layers=d.num_layers, fc_bias=d.fc_bias, vocab_size=d.vocab_size,
                       init_from_layer=d.init_from_layer, draft_vocab=draft_vocab)
    head.float().train()
    params = [p for p in head.parameters() if p.requires_grad]
    run = start_run(accelerator, head, params, tc, len(train_set), out_file.parent, position={})
    memo = (FeatureMemo(tc.feature_memo_gb, last_features(teacher, argmax=draft_vocab is not None))
            if tc.feature_memo_gb > 0 else None)

    clock = Clock(accelerator.device)
    hooks = clock.watch(teacher.get_decoder(), "target forward")
    if memo is not None:  # the memo's compute is the target's part of a miss: time it whole too
        compute = memo.compute

        def timed(ids):
            with clock("memo compute"):
                return compute(ids)

        memo.compute = timed
    geometry = _Geometry(teacher, head, tc, cfg.ttt)
    profile = _Profile(cfg, accelerator, run, teacher, memo, clock, geometry, train_set, tok.pad_token_id or 0)

    t0 = time.time()
    passes = {("epoch 1 (memo miss)" if memo is not None else "every epoch (no memo)"): profile.run_pass(
        "miss" if memo is not None else None)}
    if memo is not None:
        passes["later epochs (memo hit)"] = profile.run_pass("hit")
    for h in hooks:
        h.remove()
    compare = None
    if teacher is not target.model:  # the same target work at the target's own dtype (features_dtype=its dtype)
        compare = profile.target_alone(target.model, geometry.target_dtype_of(target.model))

    # ---- peaks on the median batch's shapes
    mid = _median_index([s.shape[0] * s.shape[1] for s in next(iter(passes.values()))])
    shapes = {g for steps in passes.values() for w in steps[mid].work.values() for g in w}
    if compare:
        shapes |= {g for w in compare[mid].work.values() for g in w}
    print(f"[profile] measuring torch.matmul peaks on {len(shapes)} GEMM shapes "
          f"({torch.get_num_threads()} threads)", flush=True)
    peaks = {g: matmul_gflops(g, cfg.peak_repeats, accelerator.device) for g in sorted(shapes, key=_shape_key)}

    report = {"target": target.identity["name_or_path"], "device": str(accelerator.device),
              "threads": torch.get_num_threads(), "batch_size": tc.batch_size, "ttt_steps": cfg.ttt.steps,
              "features_dtype": tc.features_dtype, "mixed_precision": tc.mixed_precision,
              "draft_vocab": None if draft_vocab is None else int(draft_vocab.numel()),
              "feature_memo": memo is not None, "steps": cfg.steps, "warmup": cfg.warmup,
              "median_batch": list(next(iter(passes.values()))[mid].shape), "seconds": round(time.time() - t0, 1),
              "formulas": FORMULAS, "passes": {}, "peaks": [
                  {"m": g.m, "k": g.k, "n": g.n, "batch": g.batch, "dtype": g.dtype, "gflops": round(v, 2)}
                  for g, v in peaks.items()]}
    for name, steps in passes.items():
        report["passes"][name] = summarise(steps, mid, peaks)
        print_table(name, report["passes"][name])
    if compare:
        name = f"target alone at {geometry.target_dtype_of(target.model)} (features_dtype={tc.features_dtype} above)"
        report["passes"][name] = summarise(compare, mid, peaks, whole_step=False)
        print_table(name, report["passes"][name])
    with owned_path(out_file, "output_file", REPORT, cfg.overwrite, inputs(cfg)) as tmp:
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    save_config(cfg, config_path(out_file), cfg.overwrite)
    print(f"wrote {out_file}")
    return report


FORMULAS = {
    "gemm": "2*batch*m*k*n FLOPs per [m x k] @ [k x n]; elementwise work not counted; padded rows counted",
    "stack_forward": "sum over nn.Linear (in,out) of its layers 2*R*in*out + layers * 2 * 2*B*heads*T*S*head_dim "
                     "(S = (T+1)/2 on average for the memo's unmasked causal passes)",
    "target_argmax": "2*R*H*V_full", "soft_labels_and_logits": "2*R*H*V_draft per call",
    "head_backward": "dX and dW per trainable Linear (fc's dX only from TTT step 1), 4 attention matmuls, "
                     "dX through the frozen lm_head rows",
    "peak": "sum(flops) / sum(flops / torch.matmul best GFLOP/s of each shape and dtype), median batch's shapes",
    "achieved_over_peak": "ideal time at those peaks / measured time",
}


# ------------------------------------------------------------------------------------------ the step


class _Geometry:
    """The GEMMs of each phase of a step, from the batch's shapes."""

    def __init__(self, teacher, head, tc: TrainConfig, ttt: TTTConfig):
        self.target = Stack.of(teacher.get_decoder().layers, teacher.config)
        self.head = Stack.of(head.model.layers, head.config)
        self.fc = (head.fc.in_features, head.fc.out_features)
        self.hidden = teacher.get_output_embeddings().weight.shape[1]
        self.vocab = teacher.get_output_embeddings().weight.shape[0]
        self.draft = self.vocab if head.draft_vocab is None else int(head.draft_vocab.numel())
        self.reduced = head.draft_vocab is not None
        amp = {"bf16": "bfloat16", "fp16": "float16"}.get(tc.mixed_precision)
        self.amp = amp  # the dtype of matmuls under accelerate's autocast (None: off)
        self.head_dtype = amp or "float32"  # head.float(): fp32 master weights
        self.teacher_dtype = self.target_dtype_of(teacher)
        self.ttt = ttt.steps

    @staticmethod
    def target_dtype_of(model) -> str:
        return str(next(model.parameters()).dtype).removeprefix("torch.")

    def of(self, b: int, t: int, lengths: list[int], memo: Optional[str], target_dtype: Optional[str] = None) -> dict:
        """{phase: Counter[Gemm]} of one micro-batch [b, t] (`lengths`: its real lengths; memo None | miss | hit)."""
        work = defaultdict(Counter)
        tdt = target_dtype or self.teacher_dtype
        in_amp = self.amp or tdt  # inside the loss (autocast on): the target's matmuls run at the autocast dtype
        tt = t if self.ttt > 1 else t - 1  # query positions of the head (teacher-forced: the pairs (f_t, f_{t+1}))
        rows = b * tt
        if memo == "miss":  # one unpadded sequence at a time, outside autocast
            for n in lengths:
                work["target forward"] += self.target.forward(n, 1, n, n, tdt, causal=True)
                if self.reduced:
                    work["target argmax"][Gemm(n, self.hidden, self.vocab, 1, tdt)] += 1
        elif memo is None:  # the batch, padded, inside the loss
            work["target forward"] += self.target.forward(b * t, b, t, t, in_amp)
            if self.reduced:
                work["target argmax"][Gemm(rows, self.hidden, self.vocab, 1, in_amp)] += 1
        if target_dtype is not None:  # the target alone (the comparison pass)
            return dict(work)
        work["soft labels"][Gemm(rows, self.hidden, self.draft, 1, in_amp)] += 1
        hdt = self.head_dtype
        for j in range(self.ttt):
            keys = tt * (j + 1) if self.ttt > 1 else tt  # TTT step j attends to the cache of steps 0..j
            work["head forward"][Gemm(rows, *self.fc, 1, hdt)] += 1
            work["head forward"] += self.head.forward(rows, b, tt, keys, hdt)
            work["loss"][Gemm(rows, self.hidden, self.draft, 1, hdt)] += 1
            work["backward"][Gemm(self.fc[1], rows, self.fc[0], 1, hdt)] += 1  # fc's dW
            if j > 0:  # fc's input (the previous step's output) needs its gradient
                work["backward"][Gemm(rows, self.fc[1], self.fc[0], 1, hdt)] += 1
            work["backward"] += self.head.backward(rows, b, tt, keys, hdt)
            work["backward"][Gemm(rows, self.draft, self.hidden, 1, hdt)] += 1  # dX through the lm_head rows
        return dict(work)


class _Profile:
    """Runs train/eagle.py's micro-step on the recipe's first batches, phase by phase."""

    def __init__(self, cfg, accelerator, run, teacher, memo, clock: Clock, geometry: _Geometry, train_set,
                 pad_id: int):
        self.cfg, self.tc, self.ttt = cfg, cfg.train, cfg.ttt
        self.acc, self.run, self.teacher, self.memo, self.clock = accelerator, run, teacher, memo, clock
        self.geometry, self.train_set, self.pad_id = geometry, train_set, pad_id

    def batches(self):
        """The recipe's own batches: epoch 0 of train/batching.iterate, as process 0 of 1."""
        return iterate(self.train_set, self.tc.batch_size, 0, self.tc.seed, 0, 1, self.pad_id)

    def run_pass(self, memo: Optional[str]) -> list[Step]:
        steps, clock = [], self.clock
        it = self.batches()
        for i in range(self.cfg.warmup + self.cfg.steps):
            clock.take()
            t0 = time.perf_counter()
            with clock("data"):
                _, batch = next(it)
                batch = {k: v.to(self.acc.device) for k, v in batch.items()}
                tokens = int(batch["attention_mask"].sum())
            self.micro_step(batch)
            clock._sync()
            seconds = time.perf_counter() - t0
            raw = clock.take()
            if i >= self.cfg.warmup:
                b, t = batch["input_ids"].shape
                lengths = batch["attention_mask"].sum(-1).tolist()
                steps.append(Step(seconds, exclusive(raw, seconds, self.memo is not None),
                                  self.geometry.of(b, t, lengths, memo), tokens, (b, t)))
            print(f"[profile] {'hit' if memo == 'hit' else 'miss' if memo else 'step'} {i + 1}/"
                  f"{self.cfg.warmup + self.cfg.steps}: {seconds * 1e3:.0f} ms", flush=True)
        return steps

    def micro_step(self, batch: dict) -> None:
        """train/eagle.py's micro_step (and the loop's schedule step), each phase under the clock."""
        acc, run, tc, clock = self.acc, self.run, self.tc, self.clock
        if self.memo is not None:
            with clock("memo"):
                batch.update(self.memo(batch))
        with acc.accumulate(run.head_ddp), acc.autocast():
            loss = self.loss(batch) if self.ttt.steps > 1 else self.teacher_forced_loss(batch)
            with clock("backward"):
                acc.backward(loss)
            with clock("optimizer"):
                if acc.sync_gradients and tc.grad_clip_value:
                    acc.clip_grad_value_(run.head_ddp.parameters(), tc.grad_clip_value)
                run.optimizer.step()
                run.optimizer.zero_grad(set_to_none=True)
        with clock("optimizer"):
            run.scheduler.step()

    def features(self, batch: dict) -> torch.Tensor:
        """train/eagle.py's target_features: from the memo, else the frozen target (its decoder hook times it)."""
        if "features" in batch:
            return batch["features"].float()
        with torch.no_grad():
            return self.teacher.get_decoder()(input_ids=batch["input_ids"],
                                              attention_mask=batch["attention_mask"]).last_hidden_state.float()

    def labels(self, feats: torch.Tensor, argmax: Optional[torch.Tensor]):
        """soft_labels, with the full-vocabulary argmax it would compute inside timed on its own."""
        head = self.run.head
        if argmax is None and head.draft_vocab is not None:
            with self.clock("target argmax"), torch.no_grad():
                argmax = full_argmax(self.teacher, feats)  # what soft_labels computes when not given it
        with self.clock("soft labels"):
            return soft_labels(self.teacher, feats, head.draft_vocab, argmax)

    def loss(self, batch: dict) -> torch.Tensor:
        """train/eagle.py's unrolled_loss (ttt.steps > 1), phase by phase."""
        head_ddp, head, tc, ttt, clock = self.run.head_ddp, self.run.head, self.tc, self.ttt, self.clock
        ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        feats = self.features(batch)  # [B, T, H]
        p, inside = self.labels(feats, batch.get("target_argmax"))
        with clock("head forward"):
            valid = (loss_mask * attn).float()
            inp = feats
            if tc.noise_std:
                inp = feats + (torch.rand_like(feats) - 0.5) * tc.noise_std * 512 / feats.shape[1]
            loss = torch.zeros((), device=ids.device)
            chains = ttt_unroll(head_ddp, inp, ids, attn, ttt.steps)
        stats = {}
        for j in range(ttt.steps):
            with clock("head forward"):
                pred = next(chains)  # pred[t] predicts f_{t+1+j}
            with clock("loss"):
                mask = shift(valid, 2 + j) * shift(inside, 1 + j)
                feat, tok, stats[f"acc_{j}"] = eagle_terms(head.logits(pred), pred, shift(feats, 1 + j),
                                                           shift(p, 1 + j), mask)
                loss = loss + ttt.decay ** j * (tc.w_feat * feat + tc.w_tok * tok)
                if j == 0:
                    stats.update(feat=feat.item(), tok=tok.item())
        with clock("loss"):
            stats["loss"] = loss.item()
        return loss

    def teacher_forced_loss(self, batch: dict) -> torch.Tensor:
        """train/eagle.py's eagle_loss (ttt.steps = 1), phase by phase."""
        head_ddp, head, tc, clock = self.run.head_ddp, self.run.head, self.tc, self.clock
        ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        feats = self.features(batch)
        b, t, _ = feats.shape
        inp, tgt = feats[:, :-1], feats[:, 1:]
        argmax = batch.get("target_argmax")
        p, inside = self.labels(tgt, None if argmax is None else argmax[:, 1:])
        with clock("head forward"):
            if tc.noise_std:
                inp = inp + (torch.rand_like(inp) - 0.5) * tc.noise_std * 512 / t
            pos = torch.arange(t - 1, device=ids.device)[None].expand(b, -1)
            pred = head_ddp(inp, ids[:, 1:], pos, attention_mask=attn[:, 1:])
        with clock("loss"):
            mask = torch.zeros_like(loss_mask[:, 1:], dtype=torch.float)
            mask[:, :-1] = (loss_mask[:, 2:] * attn[:, 2:]).float()
            mask = mask * inside
            feat_loss, tok_loss, _ = eagle_terms(head.logits(pred), pred, tgt, p, mask)
            loss = tc.w_feat * feat_loss + tc.w_tok * tok_loss
            loss.item(), feat_loss.item(), tok_loss.item()
        return loss

    def target_alone(self, model, dtype: str) -> list[Step]:
        """The memo-miss target work (features, and the argmax for a reduced vocabulary) on the timed batches'
        sequences, with `model` (the target at its own dtype) in place of the features_dtype copy."""
        clock, steps = self.clock, []
        compute = last_features(model, argmax=self.run.head.draft_vocab is not None)
        hooks = clock.watch(model.get_decoder(), "target forward")
        it = self.batches()
        with torch.no_grad():
            for i in range(self.cfg.warmup + self.cfg.steps):
                _, batch = next(it)
                lengths = batch["attention_mask"].sum(-1).tolist()
                clock.take()
                t0 = time.perf_counter()
                for k, n in enumerate(lengths):
                    compute(batch["input_ids"][k:k + 1, :n].to(self.acc.device))
                clock._sync()
                seconds = time.perf_counter() - t0
                raw = clock.take()
                if i >= self.cfg.warmup:
                    b, t = batch["input_ids"].shape
                    phases = {"target forward": raw["target forward"],
                              "target argmax": seconds - raw["target forward"]}
                    steps.append(Step(seconds, phases, self.geometry.of(b, t, lengths, "miss", dtype),
                                      int(sum(lengths)), (b, t)))
        for h in hooks:
            h.remove()
        return steps


def exclusive(raw: dict[str, float], seconds: float, memo: bool) -> dict[str, float]:
    """Phase seconds that do not overlap: the memo's compute holds the target's forward (and its argmax), the
    memo's own share is what remains; `other` is the step's time in none of them."""
    get = raw.get
    phases = {"data": get("data", 0.0), "target forward": get("target forward", 0.0)}
    if memo:
        phases["target argmax"] = max(0.0, get("memo compute", 0.0) - get("target forward", 0.0))
        phases["memo"] = get("memo", 0.0) - get("memo compute", 0.0)
    else:
        phases["target argmax"] = get("target argmax", 0.0)
    for name in ("soft labels", "head forward", "loss", "backward", "optimizer"):
        phases[name] = get(name, 0.0)
    phases["other"] = seconds - sum(phases.values())
    return phases


# ------------------------------------------------------------------------------------------ peaks and the table


def matmul_gflops(g: Gemm, repeats: int, device) -> float:
    """torch.matmul's best GFLOP/s on shape `g` (each timing long enough to read: >= ~20 ms of repeats)."""
    dtype = getattr(torch, g.dtype)
    lead = (g.batch,) if g.batch > 1 else ()
    a = torch.randn(*lead, g.m, g.k, device=device).to(dtype)
    b = torch.randn(*lead, g.k, g.n, device=device).to(dtype)
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
    return g.flops / min(timed(reps) for _ in range(repeats)) / 1e9


def _shape_key(g: Gemm):
    return (g.dtype, g.batch, g.k, g.n, g.m)


def _median_index(values: list[int]) -> int:
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def summarise(steps: list[Step], mid: int, peaks: dict, whole_step: bool = True) -> dict:
    """Per phase, each a median over the timed steps (robust to a step the OS interrupts): ms (and the range), share
    of its step's time, GFLOP, achieved GFLOP/s; the peak is the phase's (module docstring). `per_step` keeps the
    raw seconds and GFLOP."""
    median = statistics.median
    rows = {}
    names = [p for p in PHASES if any(s.phases.get(p, 0.0) > 0 or p in s.work for s in steps)]  # what ran
    phase_peak = {}
    for name in names:
        secs = [s.phases.get(name, 0.0) for s in steps]
        gflop = [flops(s.work.get(name, Counter())) / 1e9 for s in steps]
        row = {"ms": round(1e3 * median(secs), 2), "ms_min": round(1e3 * min(secs), 2),
               "ms_max": round(1e3 * max(secs), 2), "gflop": round(median(gflop), 4),
               "share": round(median(x / s.seconds for x, s in zip(secs, steps)), 4)}
        work = steps[mid].work.get(name)
        if work and flops(work) > 0 and min(secs) > 0:
            phase_peak[name] = flops(work) / sum(c * g.flops / (peaks[g] * 1e9) for g, c in work.items()) / 1e9
            achieved = median(f / x for f, x in zip(gflop, secs))
            row.update(achieved_gflops=round(achieved, 2), peak_gflops=round(phase_peak[name], 2),
                       ratio=round(achieved / phase_peak[name], 4))
        rows[name] = row
    # the whole step: its GEMMs at their phases' peaks (ideal seconds) against its measured seconds
    step_gflop = [sum(flops(s.work.get(n, Counter())) / 1e9 for n in phase_peak) for s in steps]
    ideal = [sum(flops(s.work.get(n, Counter())) / 1e9 / phase_peak[n] for n in phase_peak) for s in steps]
    seconds = [s.seconds for s in steps]
    whole = {"ms": round(1e3 * median(seconds), 2), "ms_min": round(1e3 * min(seconds), 2),
             "ms_max": round(1e3 * max(seconds), 2), "gflop": round(median(step_gflop), 4),
             "tokens_per_s": round(median(s.tokens / s.seconds for s in steps), 1)}
    if phase_peak:
        whole.update(achieved_gflops=round(median(f / s.seconds for f, s in zip(step_gflop, steps)), 2),
                     peak_gflops=round(sum(step_gflop) / sum(ideal), 2),
                     ratio=round(median(i / s.seconds for i, s in zip(ideal, steps)), 4))
    whole["overhead_share"] = round(sum(rows[n]["share"] for n in rows if n not in phase_peak), 4)
    per_step = [{"seconds": round(s.seconds, 4), "tokens": s.tokens, "shape": list(s.shape),
                 "phases": {n: round(s.phases.get(n, 0.0), 4) for n in names},
                 "gflop": {n: round(flops(s.work.get(n, Counter())) / 1e9, 4) for n in names if n in s.work}}
                for s in steps]
    return {"phases": rows, "step" if whole_step else "total": whole, "per_step": per_step}


def print_table(title: str, summary: dict) -> None:
    print(f"\n{title}")
    head = (f"{'phase':<16}{'ms/step':>9}{'min-max':>15}{'share':>7}{'GFLOP':>9}{'GFLOP/s':>9}{'peak':>8}"
            f"{'ach/peak':>9}")
    print(head + "\n" + "-" * len(head))
    whole_name = "step" if "step" in summary else "total"
    for name, r in [*summary["phases"].items(), (whole_name, {**summary[whole_name], "share": 1.0})]:  # medians
        if name == whole_name:
            print("-" * len(head))
        spread = f"{r['ms_min']:.0f}-{r['ms_max']:.0f}"
        rate = (f"{r['achieved_gflops']:>9.1f}{r['peak_gflops']:>8.1f}{r['ratio']:>9.2f}" if "ratio" in r
                else f"{'-':>9}{'-':>8}{'-':>9}")
        print(f"{name:<16}{r['ms']:>9.1f}{spread:>15}{r['share']:>7.1%}{r['gflop']:>9.2f}{rate}")
    w = summary[whole_name]
    print(f"{w['tokens_per_s']:.0f} tokens/s; time outside the matmul phases (data, memo, optimizer, other): "
          f"{w['overhead_share']:.1%}")


if __name__ == "__main__":
    main()
