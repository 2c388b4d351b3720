"""Fuzz the engine's losslessness: random tiny targets x every drafter x random prompts, budgets and stop tokens.

    python tests/run_harness.py fuzz cases=10000 seed=1 [families=[llama,gemma3]] [drafters=[eagle,ngram]]
        [failures_file=F]

Each case is one self-contained JSON object: the target (family, seed, size overrides, attention kernel), the
drafter and its options (EAGLE and DFlash heads described by a seed, a layer count, a draft vocabulary size and how
many fitting steps they got), the prompt ids, max_new_tokens and the stop ids. Greedy output must equal the target's
own greedy decoding (Hugging Face `generate`, do_sample=False, fp32) cut after the first stop id, with the same
stop reason; a prompt that does not fit must be refused with a UserError. A failing case is printed as one JSON
line: put it in tests/reliability/fuzz_regressions.jsonl and the test suite replays it (`run_case`).

Models are built once per spec and reused (a pool); a campaign's target shapes are drawn from its seed, so other
seeds explore other shapes. A divergence at a position where the target's two best logits are within
`tie_tolerance` is reported as a near-tie, not a failure (fp32 kernels of different shapes may round apart).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from harness.drafters import register_test_drafters

register_test_drafters()  # the fuzzer builds the test-only `oracle` and `always_wrong` drafters too

FAMILIES = ("llama", "qwen2", "gemma3")
CASE_VERSION = 1


@dataclass
class FuzzConfig:
    """Schema of conf/fuzz.yaml."""

    cases: int = field(default=1000, metadata={"help": (
        "Cases to run, and the seed that draws them (the same seed always draws the same cases and target shapes).")})
    seed: int = field(default=0, metadata={"help": "Seed that draws the cases and target shapes."})
    families: list[str] = field(default_factory=lambda: list(FAMILIES), metadata={"help": (
        "Target families to draw from, and drafters ([] = every drafter decode.drafters.known() names that the fuzzer "
        "knows how to build; unknown registered ones are reported).")})
    drafters: list[str] = field(default_factory=list, metadata={"help": "Drafters to fuzz ([] = every one it knows)."})
    pool_size: int = field(default=3, metadata={"help": (
        "Target shapes per family in the pool (each a random size, seed and attention layout).")})
    max_new_tokens: int = field(default=48, metadata={"help": (
        "Upper bound on max_new_tokens (most cases draw far fewer; long ones cost the most).")})
    failures_file: Optional[str] = field(default=None, metadata={"help": (
        "Where failing cases go as JSON lines (appended), besides stdout; null = stdout only.")})
    max_failures: int = field(default=0, metadata={"help": "Stop after this many failures (0 = run every case)."})
    tie_tolerance: float = field(default=1e-5, metadata={"help": (
        "Divergences where the target's top-2 logits are closer than this are near-ties, not failures.")})


# ----------------------------------------------------------------------------------------------- the pool


def _key(spec: Any) -> str:
    return json.dumps(spec, sort_keys=True)


class Pool:
    """Builds targets, heads and draft models from their specs once, and caches greedy references."""

    def __init__(self):
        self._objects: dict[tuple[str, str], Any] = {}
        self._refs: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def _get(self, kind: str, spec: Any, build: Callable[[], Any]):
        k = (kind, _key(spec))
        if k not in self._objects:
            self._objects[k] = build()
        return self._objects[k]

    def target(self, spec: dict):
        def build():
            from selfspec.target.model import load_target

            t = load_target(f"tiny:{spec['family']}", seed=spec["seed"], tiny=dict(spec["tiny"]))
            if spec.get("attn", "sdpa") != "sdpa":
                t.model.set_attn_implementation(spec["attn"])
            return t

        return self._get("target", spec, build)

    def draft_model(self, spec: dict):
        return self.target(spec).model

    def engine_target(self, target_spec: dict, head_spec: Optional[dict] = None):
        """The target the engine runs: the pooled one, or a private copy when the head changes the target's
        modules (a LoRA exit injects adapters into its layers); references always come from the pooled one."""
        if not _modifies_target(head_spec):
            return self.target(target_spec)

        def build():
            import copy

            t = self.target(target_spec)
            return type(t)(model=copy.deepcopy(t.model), tokenizer=t.tokenizer, identity=dict(t.identity))

        return self._get("private-target", [target_spec, head_spec], build)

    def head(self, target_spec: dict, spec: dict):
        fit = (lambda: self.fit_text(target_spec)) if spec.get("fit_steps") else None
        return self._get("head", [target_spec, spec],
                         lambda: _build_head(self.engine_target(target_spec, spec), spec, fit))

    def fit_text(self, target_spec: dict):
        """The text every fitted head of a target learns: six 6-token prompts (seeded by the target) continued
        greedily in one batch (equal lengths, no padding: each row as it would be alone), and the target's hidden
        states over it -> (ids [6, T], the decoder's output with hidden states)."""
        def build():
            model = self.target(target_spec).model
            limit = model.config.max_position_embeddings
            g = torch.Generator().manual_seed(target_spec["seed"])
            p = torch.cat([torch.randint(0, 256, (1, 6), generator=g) for _ in range(6)])  # [6, 6]
            with torch.inference_mode():
                ids = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=min(56, limit - 6),
                                     min_new_tokens=min(56, limit - 6), do_sample=False, eos_token_id=None,
                                     pad_token_id=0)  # [6, T]
            with torch.no_grad():
                return ids, model.get_decoder()(input_ids=ids, output_hidden_states=True)

        return self._get("fit-text", target_spec, build)

    def reference(self, target_spec: dict, prompt: list[int], n: int) -> list[int]:
        """The target's own greedy continuation (HF generate, no stop tokens), n tokens; longer ones are reused."""
        key = (_key(target_spec), tuple(prompt))
        have = self._refs.get(key)
        if have is None or len(have) < n:
            model = self.target(target_spec).model
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            have = out[0, len(prompt):].tolist()
            self._refs[key] = have
        return have[:n]


def _modifies_target(head_spec: Optional[dict]) -> bool:
    return bool(head_spec) and (head_spec.get("config") or {}).get("adapter") == "lora"


def _build_head(target, spec: dict, fit: Optional[Callable[[], tuple]] = None):
    """A random head (seeded) of `spec["type"]` (eagle by default, eagle3, or any other registered head type: methods/),
    optionally with a reduced draft vocabulary, optionally fitted for a few steps to the target's own greedy text
    (`fit`: Pool.fit_text) so that drafts are partly accepted (the rollback paths then get exercised)."""
    import torch.nn.functional as F

    from selfspec.target.model import lm_logits
    from selfspec.heads.vocab import top_tokens
    from selfspec.registry import method

    model = target.model
    kind = spec.get("type", "eagle")
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(spec["seed"])
    ids, out = fit() if spec.get("fit_steps") else (None, None)
    n = spec.get("vocab_size")
    options = dict(spec.get("config") or {})
    if n:
        if ids is not None:  # the most frequent tokens of the fitting text, as training would choose them
            options["draft_vocab"] = top_tokens(((r.tolist(), [1] * len(r)) for r in ids), vocab, n)
        else:
            options["draft_vocab"] = torch.randperm(vocab, generator=g)[:n]
        options["vocab_size"] = n
    if kind == "eagle":
        options["num_layers"] = spec.get("num_layers", 1)
    if kind in ("eagle3", "peagle") and spec.get("aux_layers") is not None:
        options["aux_layers"] = spec["aux_layers"]
    with torch.random.fork_rng():
        torch.manual_seed(spec["seed"])
        head = method(kind).load("head")(model, **options)
        if ids is not None and kind == "dflash":
            _fit_dflash(head, ids, out.hidden_states, vocab, spec["fit_steps"])
        elif ids is not None:
            feats = out.last_hidden_state.float()  # [6, T, H] post-norm
            # step-0 input (a P-EAGLE head's depth 1 only: its slots stay untrained, drafts beyond mostly rejected)
            inp = head.aux_states(out.hidden_states).float() if kind in ("eagle3", "peagle") else feats
            head.float().train()
            opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
            b, t, _ = feats.shape
            pos = torch.arange(t - 1)[None].expand(b, -1)
            with torch.no_grad():
                want = lm_logits(model, feats[:, 1:]).argmax(-1)  # [b, t-1] the target's next tokens
                draft_ids = head.draft_token_ids()
                if draft_ids is not None:  # target ids -> draft ids; -100 (ignored) outside the draft vocab
                    to_draft = torch.full((vocab,), -100, dtype=torch.long)
                    to_draft[draft_ids] = torch.arange(draft_ids.numel())
                    want = to_draft[want]
            for _ in range(spec["fit_steps"]):
                pred = head(inp[:, :-1], ids[:, 1:], pos)
                loss = F.cross_entropy(head.logits(pred).flatten(0, 1), want.flatten(), ignore_index=-100)
                if kind == "eagle":
                    loss = loss * 0.5 + F.smooth_l1_loss(pred, feats[:, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return head.eval().requires_grad_(False)


def _fit_dflash(head, ids, hidden_states, vocab: int, steps: int) -> None:
    """A few steps of DFlash's block loss on the target's greedy text ids [B, T]: blocks anchored at every third
    position, each block position k trained on the token at anchor + k (the head's own convention)."""
    import torch.nn.functional as F

    b, t = ids.shape
    s = head.block_size
    anchors = torch.arange(0, t - s + 1, 3)[None].expand(b, -1)  # [B, N]: every block fits the text
    labels = ids.gather(1, (anchors[:, :, None] + torch.arange(1, s)).flatten(1)).view(b, -1, s - 1)  # [B, N, S-1]
    draft_ids = head.draft_token_ids()
    if draft_ids is not None:  # target ids -> draft ids; -100 (ignored) outside the draft vocab
        to_draft = torch.full((vocab,), -100, dtype=torch.long)
        to_draft[draft_ids] = torch.arange(draft_ids.numel())
        labels = to_draft[labels]
    states = head.target_states(hidden_states).float()  # [B, T, n*H]
    head.float().train()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        logits = head.logits(head(head.context(states), ids, anchors)[:, :, 1:])  # [B, N, S-1, V_draft]
        loss = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()


# ----------------------------------------------------------------------------------------- drawing cases


def target_specs(seed: int, pool_size: int, families=FAMILIES) -> dict[str, list[dict]]:
    """The campaign's target shapes: `pool_size` per family, drawn from `seed`."""
    rng = random.Random(f"targets-{seed}")
    out: dict[str, list[dict]] = {}
    for family in families:
        out[family] = []
        for i in range(pool_size):
            heads = rng.choice([1, 2, 4])
            kv = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
            head_dim = rng.choice([8, 16])
            layers = rng.choice([1, 2, 3])
            tiny = {"hidden_size": heads * head_dim if family != "gemma3" else rng.choice([32, 48]),
                    "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
                    "intermediate_size": rng.choice([32, 64, 96]),
                    "max_position_embeddings": rng.choice([48, 64, 96, 128, 160])}
            if family == "gemma3":
                tiny["head_dim"] = head_dim
                tiny["sliding_window"] = rng.choice([4, 8, 16, 32])
                tiny["layer_types"] = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
            elif family == "qwen2" and rng.random() < 0.5:  # Qwen2's own sliding layers (above max_window_layers)
                tiny.update(use_sliding_window=True, sliding_window=rng.choice([4, 8, 16]),
                            max_window_layers=rng.randrange(layers))
            # the first shape of a family keeps sdpa; later ones may use eager attention (additive float masks)
            attn = "eager" if i > 0 and rng.random() < 0.4 else "sdpa"
            out[family].append({"family": family, "seed": rng.randrange(1000), "tiny": tiny, "attn": attn})
    return out


def head_specs(target_spec: dict, kind: str = "eagle") -> list[dict]:
    """The heads of type `kind` a target's cases draw from: random with the full or a reduced vocabulary, fitted
    with the full or a reduced vocabulary, and one more variant per type (2 layers; other aux layers)."""
    rng = random.Random(_key(target_spec) + kind)
    if kind == "eagle":
        return [
            {"seed": 1, "num_layers": 1, "vocab_size": None, "fit_steps": 0},
            {"seed": 2, "num_layers": 1, "vocab_size": rng.choice([2, 5, 16, 64]), "fit_steps": 0},
            {"seed": 3, "num_layers": 1, "vocab_size": None, "fit_steps": 40},
            {"seed": 4, "num_layers": 1, "vocab_size": rng.choice([8, 48]), "fit_steps": 40},
            {"seed": 5, "num_layers": 2, "vocab_size": None, "fit_steps": 0},
        ]
    if kind == "eagle3":
        layers = target_spec["tiny"]["num_hidden_layers"]
        # heads.eagle3's default aux layers are clamped into [1, L-1]: a 1-layer target needs them explicit
        aux = None if layers > 1 else [0, 0, 0]
        return [
            {"type": kind, "seed": 11, "vocab_size": None, "fit_steps": 0, "aux_layers": aux},
            {"type": kind, "seed": 12, "vocab_size": rng.choice([3, 16, 64]), "fit_steps": 0, "aux_layers": aux},
            {"type": kind, "seed": 13, "vocab_size": None, "fit_steps": 40, "aux_layers": aux},
            {"type": kind, "seed": 14, "vocab_size": rng.choice([8, 48]), "fit_steps": 40, "aux_layers": aux},
            {"type": kind, "seed": 15, "vocab_size": None, "fit_steps": 0,
             "aux_layers": [rng.randrange(layers) for _ in range(rng.randint(1, 3))]},
        ]
    if kind == "peagle":
        layers = target_spec["tiny"]["num_hidden_layers"]
        aux = None if layers > 1 else [0, 0, 0]
        return [
            {"type": kind, "seed": 51, "fit_steps": 0, "aux_layers": aux, "config": {"depth": rng.choice([2, 4, 8])}},
            {"type": kind, "seed": 52, "vocab_size": rng.choice([3, 16, 64]), "fit_steps": 0, "aux_layers": aux,
             "config": {"depth": 3, "num_layers": 2}},
            {"type": kind, "seed": 53, "fit_steps": 40, "aux_layers": aux, "config": {"depth": rng.choice([3, 5])}},
            {"type": kind, "seed": 54, "vocab_size": rng.choice([8, 48]), "fit_steps": 40, "aux_layers": aux,
             "config": {"depth": 4, "num_layers": 2}},
        ]
    if kind == "dflash":  # the target has >= 2 layers (draw_case): ids lie in [0, L-2]
        layers = target_spec["tiny"]["num_hidden_layers"]
        ids = sorted(rng.sample(range(layers - 1), rng.randint(1, layers - 1)))
        return [
            {"type": kind, "seed": 41, "fit_steps": 0, "config": {"block_size": rng.choice([2, 4, 8])}},
            {"type": kind, "seed": 42, "vocab_size": rng.choice([3, 16, 64]), "fit_steps": 0,
             "config": {"block_size": rng.choice([3, 6])}},
            {"type": kind, "seed": 43, "fit_steps": 30, "config": {"block_size": rng.choice([4, 8]), "num_layers": 1}},
            {"type": kind, "seed": 44, "vocab_size": rng.choice([8, 48]), "fit_steps": 30,
             "config": {"block_size": 4, "num_layers": 2}},
            {"type": kind, "seed": 45, "fit_steps": 0, "config": {"block_size": rng.choice([5, 16]),
                                                                 "target_layer_ids": ids}},
        ]
    if kind == "dspark":  # untrained DSpark heads (DFlash's body: the target has >= 2 layers, draw_case)
        return [
            {"type": kind, "seed": 61, "config": {"block_size": rng.choice([2, 4, 8]), "markov_rank": 8}},
            {"type": kind, "seed": 62, "vocab_size": rng.choice([3, 16, 64]),
             "config": {"block_size": rng.choice([3, 6]), "markov_rank": 4}},
            {"type": kind, "seed": 63, "config": {"block_size": 5, "markov_rank": 8, "confidence_head": False}},
        ]
    if kind == "layerskip":  # untrained exits (an untrained `light` exit at E = L is the target itself)
        layers = target_spec["tiny"]["num_hidden_layers"]
        return [
            {"type": kind, "seed": 31, "config": {"exit_layer": rng.randint(1, layers), "adapter": "light", "rank": 8}},
            {"type": kind, "seed": 32, "config": {"exit_layer": layers, "adapter": "light", "rank": 8}},
            {"type": kind, "seed": 33, "vocab_size": rng.choice([5, 64]),
             "config": {"exit_layer": rng.randint(1, layers), "adapter": "light", "rank": 8}},
            {"type": kind, "seed": 34, "config": {"exit_layer": rng.randint(1, layers), "adapter": "layer"}},
            {"type": kind, "seed": 35, "config": {"exit_layer": rng.randint(1, layers), "adapter": "lora",
                                                  "lora_rank": 4}},
        ]
    # a head type the fuzzer has no special knowledge of: its builder's defaults, untrained
    return [{"type": kind, "seed": 21}, {"type": kind, "seed": 22}]


def draft_model_specs(family: str, seed: int) -> list[dict]:
    """Other tiny models of the family (same tokenizer, other seeds and sizes) to draft with."""
    rng = random.Random(f"draft-{family}-{seed}")
    out = []
    for _ in range(2):
        tiny = {"hidden_size": 32, "num_hidden_layers": rng.choice([1, 2]), "num_attention_heads": 2,
                "num_key_value_heads": rng.choice([1, 2]), "intermediate_size": 64,
                "max_position_embeddings": rng.choice([64, 160])}
        if family == "gemma3":
            tiny.update(head_dim=16, sliding_window=rng.choice([8, 16]))
        out.append({"family": family, "seed": 500 + rng.randrange(1000), "tiny": tiny, "attn": "sdpa"})
    return out


# Drafters the fuzzer knows (with a relative weight). A registered drafter named after a head type in
# methods/ (e.g. a new `layerskip`) is fuzzed too, in cases of its own (case_plan), generically unless head_specs
# and _options know it: a head from its builder's defaults, then the chain/tree options every head drafter takes.
# `oracle` and `always_wrong` are the test drafters of harness/drafters.py.
WEIGHTS = {"none": 1, "ngram": 2, "suffix": 2, "eagle": 5, "eagle3": 4, "layerskip": 4, "dflash": 4, "peagle": 3,
           "draft_model": 2, "hybrid": 5, "oracle": 3, "always_wrong": 1}
HEAD_WEIGHT = 4


def _weight(drafter: str) -> int:
    return WEIGHTS.get(drafter, HEAD_WEIGHT)


def known_drafters() -> list[str]:
    """Registered drafters the fuzzer can build."""
    from selfspec.decode.drafters import known
    from selfspec.registry import names

    return [d for d in known() if d in WEIGHTS or d in names()]


def unknown_drafters() -> list[str]:
    """Registered drafters the fuzzer cannot build (neither known here nor named after a head type)."""
    from selfspec.decode.drafters import known

    return [d for d in known() if d not in known_drafters()]


def _options(rng: random.Random, drafter: str, target_spec: dict) -> dict:
    if drafter == "none":
        return {}
    if drafter == "ngram":
        hi = rng.randint(1, 4)
        return {"num_draft": rng.randint(1, 8), "max_ngram": hi, "min_ngram": rng.randint(1, hi)}
    if drafter == "suffix":
        return _suffix_options(rng)
    if drafter == "hybrid":  # a head's drafter (its own options, as fuzzed alone) beside a lookup, one of three modes
        deep = target_spec["tiny"]["num_hidden_layers"] >= 2  # a DFlash head fuses layers 0..L-2
        kind = rng.choice(["eagle", "eagle3", "peagle"] + (["dflash"] if deep else []))
        opts = _options(rng, kind, target_spec)
        opts.update(_suffix_options(rng), lookup=rng.choice(["suffix", "ngram"]),
                    hybrid_mode=rng.choice(["auto", "tree", "choose"]))
        # a chain head's leaves beside its first tokens, from a stream of the case's own (the main stream's later
        # cases stay those the other drafters were checked with)
        side = random.Random(json.dumps(opts, sort_keys=True, default=str))
        if opts.get("chain", True) and side.random() < 0.5:
            opts.update(hybrid_siblings=side.randint(1, 3), hybrid_sibling_depth=side.randint(1, 3))
        return opts
    if drafter in ("dflash", "peagle", "dspark"):  # one draft per pass: all of it, its first tokens, or a cut one
        specs = head_specs(target_spec, drafter)
        fitted = [h for h in specs if h.get("fit_steps")]
        opts = {"head": rng.choice(fitted if fitted and rng.random() < 0.5 else specs), "chain": True}
        r = rng.random()
        if r < 0.3:  # a P-EAGLE head refuses more than its depth
            opts["num_draft"] = rng.randint(1, opts["head"]["config"]["depth"] if drafter == "peagle" else 8)
        elif r < 0.45:
            opts["min_confidence"] = rng.choice([0.05, 0.3, 0.7])
        return opts
    if drafter in ("eagle", "eagle3", "layerskip") or drafter not in WEIGHTS:  # head drafters: chain or tree
        specs = head_specs(target_spec, drafter)
        fitted = [h for h in specs if h.get("fit_steps")]
        # fitted heads get drafts accepted (and partly rejected): half the cases use one when the type has any
        opts: dict[str, Any] = {"head": rng.choice(fitted if fitted and rng.random() < 0.5 else specs)}
        if rng.random() < 0.5:
            opts.update(chain=True, num_draft=rng.randint(1, 8))
        else:
            opts.update(chain=False, tree_depth=rng.randint(1, 6), tree_top_k=rng.randint(1, 6),
                        tree_total_tokens=rng.randint(1, 40))
        return opts
    if drafter == "draft_model":
        return {"draft_model": rng.choice(draft_model_specs(target_spec["family"], 0)), "num_draft": rng.randint(1, 6)}
    if drafter == "oracle":
        if rng.random() < 0.5:
            return {"num_draft": rng.randint(1, 6), "width": 1}
        width = rng.randint(2, 3)
        return {"num_draft": rng.randint(1, 3 if width == 2 else 2), "width": width}
    return {"num_draft": rng.randint(1, 6)}  # always_wrong


def _suffix_options(rng: random.Random) -> dict:
    return {"lookup_num_draft": rng.randint(1, 12), "suffix_depth": rng.randint(2, 12),
            "suffix_min_prob": rng.choice([0.0, 0.1, 0.5]), "suffix_alpha": rng.choice([0.5, 1.0, 4.0]),
            "suffix_tree": rng.random() < 0.5}


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n ids: random bytes, random ids over the whole vocabulary (special tokens included), or a repeated
    pattern (which prompt lookup can match)."""
    kind = rng.random()
    if kind < 0.45:
        return [rng.randrange(256) for _ in range(n)]
    if kind < 0.7:
        return [rng.randrange(vocab) for _ in range(n)]
    unit = [rng.randrange(256) for _ in range(rng.randint(1, 6))]
    return (unit * (n // len(unit) + 1))[:n]


def draw_case(rng: random.Random, pool: Pool, specs: dict[str, list[dict]], drafters: list[str],
              max_new_cap: int) -> dict:
    family = rng.choice(sorted(specs))
    tspec = rng.choice(specs[family])
    drafter = rng.choices(drafters, weights=[_weight(d) for d in drafters])[0]
    if drafter in ("dflash", "dspark") and tspec["tiny"]["num_hidden_layers"] < 2:  # DFlash fuses layers 0..L-2
        deep = [s for f in sorted(specs) for s in specs[f] if s["tiny"]["num_hidden_layers"] >= 2]
        tspec = rng.choice(deep) if deep else tspec
        drafter = drafter if deep else "none"
    limit = tspec["tiny"]["max_position_embeddings"]
    vocab = pool.target(tspec).model.get_output_embeddings().weight.shape[0]
    case: dict[str, Any] = {"v": CASE_VERSION, "target": tspec, "drafter": drafter,
                            "options": _options(rng, drafter, tspec)}
    if rng.random() < 0.03:  # inputs the engine must refuse, with a UserError
        n = rng.randint(1, limit)
        new = rng.choice([0, -rng.randint(1, 5), limit - n + rng.randint(1, 4)])
        case.update(prompt=_prompt(rng, n, vocab), max_new_tokens=new, eos=[], expect="error")
        return case
    r = rng.random()
    new = rng.randint(1, 6) if r < 0.35 else rng.randint(7, 16) if r < 0.8 else rng.randint(17, max(17, max_new_cap))
    new = min(new, limit - 1)
    r = rng.random()
    if r < 0.3:
        n = rng.randint(1, min(8, limit - new))
    elif r < 0.8:
        n = rng.randint(1, limit - new)
    else:  # at or near the context limit
        n = max(1, limit - new - rng.randint(0, 2))
    prompt = _prompt(rng, n, vocab)
    ref = pool.reference(tspec, prompt, new)
    r = rng.random()
    if r < 0.3:
        eos = []
    elif r < 0.45:
        eos = None  # the target's own end-of-turn ids
    else:  # ids that do occur in the reference: generation stops inside a draft, at the bonus, or at once
        eos = sorted({ref[rng.randrange(len(ref))] for _ in range(rng.randint(1, 2))}
                     | {rng.randrange(vocab) for _ in range(rng.randint(0, 2))})
    case.update(prompt=prompt, max_new_tokens=new, eos=eos, expect="greedy")
    return case


# ------------------------------------------------------------------------------------------- running one


def build_case_drafter(case: dict, pool: Pool):
    from selfspec.decode.drafters import build_drafter

    target = pool.engine_target(case["target"], case["options"].get("head"))
    opts = dict(case["options"])
    if "head" in opts:
        opts["head"] = pool.head(case["target"], opts["head"])
    if "draft_model" in opts:
        opts["draft_model"] = pool.draft_model(opts["draft_model"])
    return build_drafter(case["drafter"], target, **opts)


def run_case(case: dict, pool: Optional[Pool] = None, tie_tolerance: float = 1e-5) -> dict:
    """-> {"ok": bool, "why": str (failures), "near_tie": bool, and counters for coverage reports}."""
    from selfspec.decode.engine import stop_token_ids, generate
    from selfspec.core.errors import UserError

    pool = pool or Pool()
    target = pool.engine_target(case["target"], case["options"].get("head"))
    prompt, new = case["prompt"], case["max_new_tokens"]
    info = {"ok": True, "why": "", "near_tie": False, "drafter": case["drafter"], "stop": None,
            "eos_in_draft": False, "accepted": 0, "near_limit": False}
    try:
        drafter = build_case_drafter(case, pool)
    except Exception as e:  # noqa: BLE001 - a drafter that cannot be built for a valid spec is a failure
        return {**info, "ok": False,
                "why": f"building the drafter: {type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    if case["expect"] == "error":
        try:
            generate(target, drafter, prompt, new, eos_token_ids=case["eos"])
        except UserError:
            info["stop"] = "refused"
            return info
        except Exception as e:  # noqa: BLE001 - anything but a UserError is a failure
            return {**info, "ok": False, "why": f"expected a UserError, got {type(e).__name__}: {e}"}
        return {**info, "ok": False, "why": "expected a UserError, generation ran"}
    eos = set(stop_token_ids(target) if case["eos"] is None else case["eos"])
    ref = pool.reference(case["target"], prompt, new)
    hit = next((i for i, t in enumerate(ref) if t in eos), None)  # stop at the first stop id, and include it
    want, want_stop = (ref, "length") if hit is None else (ref[: hit + 1], "eos")
    chunks: list[list[int]] = []
    try:
        r = generate(target, drafter, prompt, new, eos_token_ids=case["eos"],
                     stream_callback=lambda t: chunks.append(list(t)))
    except Exception as e:  # noqa: BLE001 - a crash is a failure too
        return {**info, "ok": False, "why": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    info.update(stop=r.stop_reason, accepted=sum(r.accepted_by_position),
                eos_in_draft=r.stop_reason == "eos" and bool(chunks) and len(chunks[-1]) >= 2,
                near_limit=len(prompt) + new >= case["target"]["tiny"]["max_position_embeddings"] - 2)
    problems = []
    if r.tokens != want:
        i = next((i for i, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(r.tokens), len(want)))
        margin = _top2_margin(target.model, prompt + want[:i]) if i < len(want) else float("inf")
        if margin < tie_tolerance:
            info["near_tie"] = True
            return info
        problems.append(f"tokens differ at {i}: got {r.tokens[i:i + 4]} want {want[i:i + 4]} "
                        f"(top-2 margin {margin:.2e}; got {len(r.tokens)} tokens, want {len(want)})")
    if r.stop_reason != want_stop:
        problems.append(f"stop_reason {r.stop_reason}, want {want_stop}")
    if [t for c in chunks for t in c] != r.tokens:
        problems.append("streamed tokens differ from the result")
    if r.target_passes != r.verify_passes + 1 or r.committed_by_verify != len(r.tokens) - 1:
        problems.append(f"pass accounting: {r.target_passes} passes, {r.verify_passes} verify, "
                        f"{r.committed_by_verify} committed for {len(r.tokens)} tokens")
    acc, prop = r.accepted_by_position, r.proposed_by_position
    if any(a > p for a, p in zip(acc, prop)) or any(b > a for a, b in zip(acc, acc[1:])):
        problems.append(f"acceptance counts inconsistent: accepted {acc} proposed {prop}")
    if case["drafter"] in ("none", "always_wrong") and any(acc):
        problems.append(f"{case['drafter']} had drafts accepted: {acc}")
    if problems:
        return {**info, "ok": False, "why": "; ".join(problems)}
    return info


def _top2_margin(model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


# ------------------------------------------------------------------------------------------------ campaigns


def case_plan(cases: int, seed: int, part: int, drafters: list[str]) -> list[tuple[random.Random, list[str]]]:
    """(stream, the drafters a case is drawn among) per case: `cases` from one stream over the drafters of WEIGHTS,
    then for each other drafter (a head type registered since: DSpark) its share at HEAD_WEIGHT from a stream of its
    own. A method registered later adds its cases and changes none of the cases the others were checked with."""
    tag = f"-{part}" if part else ""
    known = [d for d in drafters if d in WEIGHTS]
    main = random.Random(f"cases-{seed}{tag}")
    plan = [(main, known)] * cases if known else []
    total = sum(_weight(d) for d in known) or HEAD_WEIGHT
    for d in (d for d in drafters if d not in WEIGHTS):
        own = random.Random(f"cases-{seed}-{d}{tag}")
        plan += [(own, [d])] * max(1, round(cases * HEAD_WEIGHT / total))
    return plan


def campaign(cases: int, seed: int, families=FAMILIES, drafters=None, pool_size: int = 3, max_new_tokens: int = 48,
             pool: Optional[Pool] = None, tie_tolerance: float = 1e-5, on_failure: Optional[Callable] = None,
             max_failures: int = 0, progress: bool = False, part: int = 0) -> dict:
    """Draw and run `cases` cases from `seed` (target shapes) and `part` (the case stream: parts of one seed share
    their targets, heads and references). -> {"cases", "failures": [(case, why)], "near_ties", "stats"}."""
    from collections import Counter

    torch.set_num_threads(1)  # tiny models: one thread is fastest and leaves the other cores alone
    pool = pool or Pool()
    drafters = list(drafters) if drafters else known_drafters()
    bad = [d for d in drafters if d not in known_drafters()]
    if bad:
        from selfspec.core.errors import UserError

        raise UserError(f"the fuzzer cannot build drafter(s) {bad}; it knows {known_drafters()}")
    specs = target_specs(seed, pool_size, tuple(families))
    plan = case_plan(cases, seed, part, drafters)
    failures, near_ties, stats = [], [], Counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cases, desc="fuzz", unit="case", dynamic_ncols=True)
    ran = 0
    for rng, among in plan:
        case = draw_case(rng, pool, specs, among, max_new_tokens)
        res = run_case(case, pool, tie_tolerance)
        ran += 1
        stats[f"drafter:{res['drafter']}"] += 1
        stats[f"family:{case['target']['family']}"] += 1
        stats[f"stop:{res['stop']}"] += 1
        stats["eos_in_draft"] += res["eos_in_draft"]
        stats["near_limit"] += res["near_limit"]
        stats["accepted_tokens"] += res["accepted"]
        if "head" in case["options"]:
            shape = "chain" if case["options"].get("chain") else "tree"
            stats[f"{case['drafter']}_{shape}"] += 1
            stats[f"{case['drafter']}_{shape}_accepted"] += res["accepted"]
        if res["near_tie"]:
            near_ties.append(case)
        if not res["ok"]:
            failures.append((case, res["why"]))
            if on_failure is not None:
                on_failure(case, res["why"])
        if bar is not None:
            bar.update(1)
            bar.set_postfix(failures=len(failures), near_ties=len(near_ties))
        if max_failures and len(failures) >= max_failures:
            break
    if bar is not None:
        bar.close()
    return {"cases": ran, "failures": failures, "near_ties": near_ties, "stats": dict(stats)}


def _main(cfg) -> dict:
    from omegaconf import OmegaConf

    from selfspec.core.errors import UserError

    if cfg.cases < 1 or cfg.pool_size < 1 or cfg.max_new_tokens < 1:
        raise UserError("cases, pool_size and max_new_tokens must be >= 1")
    unknown = [f for f in cfg.families if f not in FAMILIES]
    if unknown:
        raise UserError(f"unknown families {unknown}; use some of {list(FAMILIES)}")
    skipped = unknown_drafters()
    if skipped and not cfg.drafters:
        print(f"[fuzz] registered drafters the fuzzer cannot build yet (not fuzzed): {skipped}", file=sys.stderr)
    out = open(cfg.failures_file, "a") if cfg.failures_file else None

    def report(case, why):
        line = json.dumps(case, sort_keys=True)
        print(f"FAIL {why}\n{line}", flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    t0 = time.time()
    try:
        result = campaign(cfg.cases, cfg.seed, cfg.families, list(cfg.drafters) or None, cfg.pool_size,
                          cfg.max_new_tokens, tie_tolerance=cfg.tie_tolerance, on_failure=report,
                          max_failures=cfg.max_failures, progress=True)
    finally:
        if out is not None:
            out.close()
    secs = time.time() - t0
    for case in result["near_ties"]:
        print(f"NEAR-TIE (not a failure) {json.dumps(case, sort_keys=True)}")
    summary = {"cases": result["cases"], "failures": len(result["failures"]), "near_ties": len(result["near_ties"]),
               "seconds": round(secs, 1), "seed": cfg.seed, "config": OmegaConf.to_container(cfg),
               "stats": dict(sorted(result["stats"].items()))}
    print(json.dumps(summary), flush=True)
    if result["failures"]:
        raise UserError(f"{len(result['failures'])} of {result['cases']} cases failed (JSON lines above; add them to "
                        "tests/reliability/fuzz_regressions.jsonl to replay them in the test suite)")
    return summary


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None):
    from harness import entry

    return entry("fuzz", FuzzConfig)(_main)(argv, prog=prog)
