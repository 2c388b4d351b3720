"""The registry of drafting methods: what each head type brings, one entry per method.

    method(name)     -> its Method (a one-line UserError naming the known ones if there is none)
    names()          -> the registered head types, in registration order
    register(method) -> one more (a toy method from outside the package registers the same way)

A Method says everything the shared machinery asks of a head type: how to build its head, its draft options'
schema, its drafter, its export and import layouts, its model-card section, which engines load its exports, and
how a checkpoint of it must read. Shared code asks `method(kind).<field>` and never names a method; a method's code
lives in its folder, methods/<name>/, and a new method is that folder and one `register(Method(...))` entry below.

This file is data: it imports nothing of the house but core/errors.py, so every room may read it and the method
folders (which import the shared rooms) sit above them all.

Fields that name code are "module:attribute" strings resolved on first use (`Method.load`), so reading the registry
(config validation before the target loads, `--help`) imports no torch, and no import circle can run through it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional

from selfspec.core.errors import UserError


@dataclass(frozen=True)
class Method:
    name: str  # the head type: a checkpoint's record, drafter=<name>, draft=<name> (methods/<name>/conf/)
    title: str  # what readers know it by (the model card)
    head: str  # builder(target_model, **head_config) -> the head module
    schema: str  # the dataclass of its `draft:` options (its draft/<name>.yaml lists <name>_schema)
    drafter: str  # builder(target, head=, **options) -> its drafter (decode/drafters' flat options)
    card: str  # its model-card module: section(head_config, target_record, state) -> (diagram lines, table rows);
    # serving(repo_id, head_config, base, llama_layer) -> the engines' commands and unserved(...) -> why none, if any
    tags: tuple[str, ...] = ()  # its Hub tags, after the shared ones
    formats: Optional[str] = None  # module with EXPORTERS, IMPORTERS, read_back, detect (None: it exports nowhere)
    detect_rank: int = 50  # import `layout=auto` tries lower ranks first (a layout holding another's tensors first)
    recorded: tuple[str, ...] = ()  # head config keys its records must state (a default picked at load could differ)
    layered: bool = False  # its config has `layer` (heads/layers.py LAYERS), which records older than it lack
    hybrid: Optional[str] = None  # beside a lookup: "chain" (the hybrid's chain length applies), "block" (it keeps
    # its block or depth), None (it cannot share a pass: a LayerSkip exit drafts inside the target's own cache)
    engines: dict[str, str] = field(default_factory=dict)  # engine -> the export format it serves (engines/families)
    ranges: tuple[tuple[str, int, int], ...] = ()  # head config keys of its own: (key, least, most) a record may state
    hits: Optional[str] = None  # held-out hits of drafts that are no greedy chain, (head, target, sequences, depth)
    # -> (hits, drafts) (eval/compare.py; None: a greedy chain of `depth`, as EAGLE decodes)
    recipe: str = ""  # the module of its training recipe (`main(argv)`; `selfspec train <name>`, accelerate launch -m)
    tiny: Optional[tuple[str, ...]] = None  # its recipe's own overrides to train a few steps on a tiny target
    # (train/tiny.py: the engine-family checks); None: not trained there
    per_pass: Optional[str] = None  # a block drafter's tokens per draft pass, (recorded head config) -> int (the
    # serving benchmark's longest draft); None: a chain, whose length is the engine's knob
    converter: Optional[str] = None  # the export layout llama.cpp's converter reads to write this head's GGUF (the
    # serving benchmark compares ours with its output byte for byte)
    refusals: dict[str, str] = field(default_factory=dict)  # engine -> why it cannot serve this head type though
    # it names the method (said on that engine's rows by the serving benchmark)
    vllm: dict[str, Any] = field(default_factory=dict)  # vLLM's speculative_config for its export, beyond the model
    # folder and the draft length ({} = method: the head type)

    def load(self, what: str) -> Any:
        """The object a "module:attribute" field names, imported now (`what`: the field's name)."""
        module, _, attr = getattr(self, what).partition(":")
        found = importlib.import_module(module)
        return getattr(found, attr) if attr else found

    def drafts_per_pass(self, head: dict[str, Any]) -> Optional[int]:
        """A block drafter's tokens per draft pass from its recorded head config (`per_pass`); None for a chain."""
        return self.load("per_pass")(head) if self.per_pass else None

    def most(self, key: str) -> int:
        """The largest value of head config `key` a record may state (its `ranges` entry)."""
        return next(high for name, _, high in self.ranges if name == key)


_METHODS: dict[str, Method] = {}


def register(m: Method) -> Method:
    """Add a method; a name already taken by another Method is refused (ValueError: a programming error)."""
    if _METHODS.get(m.name, m) != m:
        raise ValueError(f"method '{m.name}' is already registered")
    _METHODS[m.name] = m
    return m


def unregister(name: str) -> None:
    """Drop a method registered by a test (the shipped ones stay)."""
    if name in SHIPPED:
        raise ValueError(f"method '{name}' ships with selfspec and stays registered")
    _METHODS.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_METHODS)


def method(name: str) -> Method:
    if name not in _METHODS:
        raise UserError(f"unknown head type '{name}'; known: {', '.join(_METHODS)}")
    return _METHODS[name]


def serving(engine: str) -> dict[str, str]:
    """head type -> the export format `engine` loads, for the types whose entry names that engine (Method.engines)."""
    return {m.name: m.engines[engine] for m in _METHODS.values() if engine in m.engines}


def exporting() -> list[Method]:
    """The methods with export and import layouts (Method.formats), in registration order."""
    return [m for m in _METHODS.values() if m.formats]


# EAGLE-1/2: one decoder layer over the fused (feature, token) pair, extrapolating the target's last hidden state.
register(Method(
    name="eagle", title="EAGLE-1/2", tags=("eagle",),
    head="selfspec.methods.eagle.head:build_eagle", schema="selfspec.methods.eagle.head:EagleConfig",
    drafter="selfspec.methods.eagle.drafter:build_eagle", card="selfspec.methods.eagle.card",
    formats="selfspec.methods.eagle.formats", detect_rank=90,  # an EAGLE-1 folder is EAGLE-3's without hidden_norm
    layered=True, hybrid="chain", engines={"vllm": "eagle"},
    recipe="selfspec.methods.eagle.train", tiny=()))

# EAGLE-3: the head fuses low, middle and high target layers and is trained with a training-time test.
register(Method(
    name="eagle3", title="EAGLE-3", tags=("eagle3", "eagle"),
    head="selfspec.methods.eagle3.head:build_eagle3", schema="selfspec.methods.eagle3.head:Eagle3Config",
    drafter="selfspec.methods.eagle3.drafter:build", card="selfspec.methods.eagle3.card",
    formats="selfspec.methods.eagle3.formats", detect_rank=60,
    layered=True, hybrid="chain", engines={"vllm": "speculators", "llamacpp": "gguf"}, converter="speculators",
    recipe="selfspec.methods.eagle3.train", tiny=("ttt.steps=2",)))

# LayerSkip: an early exit after layer E of the frozen target; the first E layers draft, the full model verifies.
register(Method(
    name="layerskip", title="LayerSkip early-exit", tags=("layerskip", "early-exit"),
    head="selfspec.methods.layerskip.head:build_layerskip", schema="selfspec.methods.layerskip.head:LayerSkipConfig",
    drafter="selfspec.methods.layerskip.drafter:build", card="selfspec.methods.layerskip.card",
    recipe="selfspec.methods.layerskip.train", tiny=("draft.exit_layer=1", "draft.rank=8")))

# DFlash: a block drafter proposing a whole block of tokens in one bidirectional pass over the target's features.
register(Method(
    name="dflash", title="DFlash block", tags=("dflash",),
    head="selfspec.methods.dflash.head:build_dflash", schema="selfspec.methods.dflash.head:DFlashConfig",
    drafter="selfspec.methods.dflash.drafter:build", card="selfspec.methods.dflash.card",
    formats="selfspec.methods.dflash.formats", detect_rank=10,  # a DFlash folder holds an fc and layers.* too
    recorded=("block_size", "mask_token_id"), ranges=(("block_size", 2, 64),), hybrid="block",
    engines={"vllm": "speculators", "llamacpp": "gguf"}, converter="sglang",
    per_pass="selfspec.methods.dflash.drafter:per_pass",
    hits="selfspec.methods.dflash.acceptance:hits", recipe="selfspec.methods.dflash.train",
    tiny=("draft.block_size=4", "draft.num_layers=1", "dflash.anchors=8")))

# P-EAGLE: an EAGLE-3 head that drafts its whole depth in one parallel pass (mask tokens for the future inputs).
register(Method(
    name="peagle", title="P-EAGLE parallel", tags=("peagle", "eagle3", "eagle"),
    head="selfspec.methods.peagle.head:build_peagle", schema="selfspec.methods.peagle.head:PEagleConfig",
    drafter="selfspec.methods.peagle.drafter:build", card="selfspec.methods.peagle.card",
    formats="selfspec.methods.peagle.formats", detect_rank=70,  # speculators only: its config names it
    recorded=("depth", "mask_token_id"), ranges=(("depth", 2, 16),), hybrid="block",
    engines={"vllm": "speculators"},  # vLLM serves it as EAGLE-3 drafting its depth in one pass (parallel_drafting)
    vllm={"method": "eagle3", "parallel_drafting": True},
    per_pass="selfspec.methods.peagle.drafter:per_pass",
    hits="selfspec.methods.peagle.acceptance:hits", recipe="selfspec.methods.peagle.train"))

# DSpark: DFlash's block read anchor-first, chained slot by slot by a low-rank Markov bias on the previous token, and
# cut where a confidence head's predicted acceptance falls low.
register(Method(
    name="dspark", title="DSpark semi-autoregressive block", tags=("dspark", "dflash"),
    head="selfspec.methods.dspark.head:build_dspark", schema="selfspec.methods.dspark.head:DSparkConfig",
    drafter="selfspec.methods.dspark.drafter:build", card="selfspec.methods.dspark.card",
    formats="selfspec.methods.dspark.formats", detect_rank=5,  # a DSpark folder holds a DFlash folder's tensors too
    recorded=("block_size", "mask_token_id", "markov_rank"), ranges=(("block_size", 2, 64), ("markov_rank", 1, 4096)),
    hybrid="block", engines={"llamacpp": "gguf"}, converter="sglang",
    # vLLM 0.32 names a `dspark` method (vllm/config/speculative.py:69) that its CPU build refuses at start (tried
    # 2026-11-29 with our speculators export)
    refusals={"vllm": "vLLM 0.32's CPU build cannot run it: its Model Runner V1 refuses the method (vllm/config/"
                      "vllm.py:2976-2979, 'DSpark is implemented only by the V2 GPU model runner') and without "
                      "Triton it runs V1 (vllm/config/vllm.py:726)"},
    per_pass="selfspec.methods.dspark.drafter:per_pass",
    hits="selfspec.methods.dspark.acceptance:hits", recipe="selfspec.methods.dspark.train",
    tiny=("draft.block_size=4", "draft.num_layers=1", "draft.markov_rank=8", "dspark.anchors=8")))

SHIPPED = names()
# The head type every engine here serves (selfspec, vLLM, llama.cpp): what the checks that train or decode one method
# take by default (scripts/contention.py's hybrid and train rows, scripts/check_gpu.py's train phase).
FLAGSHIP = "eagle3"
