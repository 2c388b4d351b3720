"""Drafters: one file each, one small interface (see decode/draft.py), a plain dict registry.

    build_drafter(name, target, **options) -> drafter or None (name "none": the target alone)
    register(name, builder)                -> one more drafter (tests add theirs)

Options are flat keywords; each builder takes those it understands and ignores the rest, so one CLI config
serves every drafter. num_draft None (or left out) is each drafter's own length: decode/draft.NUM_DRAFT for a
chain, the whole block for DFlash, the trained depth for P-EAGLE. `check_options(**options)` refuses impossible
values in one line; build_drafter calls it, and entry points call it first, before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from selfspec.core.errors import UserError
from selfspec.decode.draft import NUM_DRAFT
from selfspec.registry import method, names

# the suffix lookup's defaults, one home for LookupConfig, the suffix builder and decode/drafters/suffix.SuffixDrafter
SUFFIX_DEPTH, SUFFIX_MIN_PROB, SUFFIX_ALPHA = 24, 0.1, 1.0


@dataclass
class LookupConfig:
    """The lookup drafter of drafter=suffix and of drafter=hybrid (a head beside a lookup, one target pass); the
    `lookup` node of generate, bench and serve_bench."""

    kind: str = field(default="suffix", metadata={"help": (
        "drafter=hybrid's lookup: suffix (a suffix trie of the prompt and output, SuffixDecoding) or ngram (prompt "
        "lookup; max_ngram / min_ngram).")})
    num_draft: Optional[int] = field(default=16, metadata={"help": (
        "The lookup's most draft tokens per pass (a suffix tree's nodes); null = decode/draft.NUM_DRAFT. A lookup "
        "costs nothing to draft, only the longer verification, and drafts long only where its match is frequent.")})
    depth: int = field(default=SUFFIX_DEPTH, metadata={"help": (
        "suffix: the longest substring counted (matches of at most depth - 1 tokens); memory ~ depth nodes a token.")})
    min_prob: float = field(default=SUFFIX_MIN_PROB, metadata={"help": (
        "suffix: the lowest path probability drafted (the product of the empirical probabilities of its tokens).")})
    alpha: float = field(default=SUFFIX_ALPHA, metadata={"help": (
        "suffix: draft depth per matched token (a 2-token match drafts at most 2 deep at 1.0, SuffixDecoding's and "
        "vLLM's max_spec_factor; at 4.0 it drafted deeper on counts of one and ran 6-8 % slower on the suites: "
        "docs/hybrid.md).")})
    tree: bool = field(default=False, metadata={"help": (
        "suffix: draft the best-scoring nodes as a tree (several continuations) instead of the most frequent chain.")})
    corpus: Optional[str] = field(default=None, metadata={"help": (
        "suffix: a corpus of earlier outputs matched too (a generate output_file JSONL, a JSONL of {\"text\"}, or a "
        "UTF-8 text file; at most 64 MiB), as SuffixDecoding's global tree.")})
    head_num_draft: Optional[int] = field(default=6, metadata={"help": (
        "drafter=hybrid: the head's chain (EAGLE-1/3; a DFlash or P-EAGLE head drafts its block or depth); null = "
        "num_draft.")})
    head_min_confidence: Optional[float] = field(default=0.2, metadata={"help": (
        "drafter=hybrid: the head's chain stops once the product of its tokens' probabilities falls below this "
        "(the lookup drafts the long spans; a head's low-confidence tail costs a step each); null = min_confidence.")})
    head_siblings: int = field(default=3, metadata={"help": (
        "drafter=hybrid, greedy, an EAGLE-1/3 head's chain: beside each of its first head_sibling_depth tokens, the "
        "head's next likeliest head_siblings tokens as leaves. The first tokens are where a head is most often "
        "wrong, and a second guess there costs a verification row, not a head step (the trim keeps the leaves that "
        "pay for their rows: docs/hybrid.md); 0 = the chain alone.")})
    head_sibling_depth: int = field(default=3, metadata={"help": (
        "drafter=hybrid, head_siblings: how many of the chain's first tokens get them.")})
    trim: bool = field(default=True, metadata={"help": (
        "drafter=hybrid, greedy: cut each round's draft to its likeliest nodes, as many as pay for the rows they add "
        "to the verification pass (each drafter's node scores calibrated on what the target accepted, a pass's "
        "cost per row count measured in the run: docs/hybrid.md).")})
    mode: str = field(default="auto", metadata={"help": (
        "drafter=hybrid: auto (the head alone where the lookup expects little, else the lookup with the head "
        "beside it wherever the head's measured gain at the lookup's confidence pays its time; sampling: the "
        "lookup alone where it expects at least the head's accepted tokens), tree (always both) or choose (the "
        "one expecting more, alone).")})


def lookup_options(lookup) -> dict[str, Any]:
    """A LookupConfig (or its composed config node) as build_drafter's flat keywords."""
    return dict(lookup=lookup.kind, lookup_num_draft=lookup.num_draft, suffix_depth=lookup.depth,
                suffix_min_prob=lookup.min_prob, suffix_alpha=lookup.alpha, suffix_tree=lookup.tree,
                suffix_corpus=lookup.corpus, hybrid_mode=lookup.mode, hybrid_num_draft=lookup.head_num_draft,
                hybrid_min_confidence=lookup.head_min_confidence, hybrid_trim=lookup.trim,
                hybrid_siblings=lookup.head_siblings, hybrid_sibling_depth=lookup.head_sibling_depth)


def lookup_num_draft(lookup) -> int:
    """The most tokens a LookupConfig's lookup drafts a pass (num_draft; decode/draft.NUM_DRAFT where it is null): the
    length every engine's suffix row is labelled and run with."""
    return NUM_DRAFT if lookup.num_draft is None else lookup.num_draft


def vocab_size_of(target) -> int:
    return target.model.get_output_embeddings().weight.shape[0]


def _ngram(target, num_draft: Optional[int] = None, max_ngram: int = 3, min_ngram: int = 1, **_):
    from selfspec.decode.drafters.ngram import NgramDrafter

    return NgramDrafter(num_draft=num_draft, max_ngram=max_ngram, min_ngram=min_ngram)


def _suffix(target, lookup_num_draft: Optional[int] = None, suffix_depth: int = SUFFIX_DEPTH,
            suffix_min_prob: float = SUFFIX_MIN_PROB, suffix_alpha: float = SUFFIX_ALPHA, suffix_tree: bool = False,
            suffix_corpus: Optional[str] = None, **_):
    from selfspec.decode.drafters.suffix import SuffixDrafter

    corpus = None
    if suffix_corpus is not None:
        from selfspec.decode.drafters.corpus import load_corpus

        corpus = load_corpus(suffix_corpus, target.tokenizer, depth=suffix_depth)
    return SuffixDrafter(num_draft=lookup_num_draft, depth=suffix_depth, min_prob=suffix_min_prob,
                         alpha=suffix_alpha, tree=suffix_tree, corpus=corpus)


def _lookup(target, lookup: str = "suffix", lookup_num_draft: Optional[int] = None, max_ngram: int = 3,
            min_ngram: int = 1, **options):
    """The hybrid's lookup drafter: suffix (its options suffix_*) or ngram (max_ngram, min_ngram)."""
    if lookup == "ngram":
        return _ngram(target, num_draft=lookup_num_draft, max_ngram=max_ngram, min_ngram=min_ngram)
    return _suffix(target, lookup_num_draft=lookup_num_draft, **options)


def lookup_drafter(target, lookup):
    """The lookup a LookupConfig (or its composed node) describes, alone (scripts/replay_lookup.py): its options
    checked first, a corpus read with the target's tokenizer (`target` needs only `.tokenizer`)."""
    options = lookup_options(lookup)
    check_options(**options)
    return _lookup(target, **options)  # the hybrid_* keys are the hybrid's: the lookups' builders ignore them


def _hybrid(target, head: Any = None, draft_model: Any = None, head_revision: Optional[str] = None,
            hybrid_mode: str = "auto", hybrid_num_draft: Optional[int] = None,
            hybrid_min_confidence: Optional[float] = None, hybrid_trim: bool = True, hybrid_siblings: int = 0,
            hybrid_sibling_depth: int = 0, **options):
    """A head's drafter (the type head= records; or draft_model=) and a lookup (lookup=suffix|ngram), verified
    together (decode/drafters/hybrid.py). The head's chain: hybrid_num_draft / hybrid_min_confidence where given, else
    num_draft / min_confidence (a DFlash or P-EAGLE head keeps num_draft: its block or depth); an EAGLE-1/3 chain's
    leaves beside its first tokens: hybrid_siblings / hybrid_sibling_depth (greedy)."""
    from selfspec.decode.drafters.hybrid import HybridDrafter

    if head is None and draft_model is None:
        raise UserError("drafter=hybrid needs head=<a trained head> (or draft_model=): the lookup drafts beside it")
    own = dict(options)
    if hybrid_min_confidence is not None:
        own["min_confidence"] = hybrid_min_confidence
    if head is not None:
        kind = check_hybrid_head(head_type_of(head, head_revision))
        if method(kind).hybrid == "chain":
            own.update(siblings=hybrid_siblings, sibling_depth=hybrid_sibling_depth)
            if hybrid_num_draft is not None:
                own["num_draft"] = hybrid_num_draft
        drafter = method(kind).load("drafter")(target, head=head, head_revision=head_revision, **own)
    else:
        if hybrid_num_draft is not None:
            own["num_draft"] = hybrid_num_draft
        drafter = _draft_model(target, draft_model=draft_model, **own)
    return HybridDrafter(drafter, _lookup(target, **options), mode=hybrid_mode, trim=hybrid_trim)


def check_hybrid_head(kind: str) -> str:
    """`kind`, if its drafter can share a pass with a lookup's branch (methods/ Method.hybrid), else one line."""
    if method(kind).hybrid is None:
        takers = ", ".join(m for m in names() if method(m).hybrid)
        raise UserError(f"drafter=hybrid takes a head of type {takers}; this head is '{kind}' (its drafter cannot "
                        f"share a pass with a second branch: a LayerSkip exit drafts inside the target's own cache)")
    return kind


def head_type_of(head: Any, revision: Optional[str] = None) -> str:
    """The type of a head spec (folder, file, Hub id) or of a loaded head module."""
    if isinstance(head, str):
        from selfspec.heads.checkpoint import head_type

        return head_type(head, revision)
    return getattr(head, "head_type", "?")


def _draft_model(target, draft_model: Any = None, num_draft: Optional[int] = None, min_confidence: float = 0.0, **_):
    from selfspec.decode.drafters.draft_model import DraftModelDrafter

    if draft_model is None:
        raise UserError("drafter=draft_model needs draft_model=<Hub id, folder, or tiny:<family>>")
    if isinstance(draft_model, str):
        from selfspec.target.model import load_target

        device = next(target.model.parameters()).device
        draft_model = load_target(draft_model, dtype=str(target.model.dtype).replace("torch.", ""),
                                  device=device).model
    elif not hasattr(draft_model, "get_decoder"):  # a selfspec.target.model.Target
        draft_model = draft_model.model
    return DraftModelDrafter(draft_model, vocab_size=vocab_size_of(target), num_draft=num_draft,
                             min_confidence=min_confidence)


# The drafters that are no head type's (each head type's is its Method's: methods/).
DRAFTERS: dict[str, Callable] = {
    "none": lambda target, **_: None,
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
    "hybrid": _hybrid,
}


def register(name: str, builder: Callable) -> None:
    """Add a drafter: `builder(target, **options)` returns it (options as above). Tests add their oracle drafters
    this way (tests/harness/drafters.py); a name already taken by another builder or a head type is refused."""
    if DRAFTERS.get(name, builder) is not builder or name in names():
        raise ValueError(f"drafter '{name}' is already registered")
    DRAFTERS[name] = builder


def known() -> tuple[str, ...]:
    """Every drafter name: none, the head types' (methods/), then the others."""
    return ("none", *names(), *(d for d in DRAFTERS if d != "none"))


def build_drafter(name: str, target, **options):
    if name not in known():
        raise UserError(f"unknown drafter '{name}'; known: {', '.join(known())}")
    check_options(context=getattr(target, "context", None), **options)
    builder = method(name).load("drafter") if name in names() else DRAFTERS[name]
    return builder(target, **options)


# Options that count something: each must be at least this (their CLI names, for the message).
_AT_LEAST = {"num_draft": ("num_draft", 1), "tree_depth": ("tree.depth", 1), "tree_top_k": ("tree.top_k", 1),
             "tree_total_tokens": ("tree.total_tokens", 1), "min_ngram": ("min_ngram", 1),
             "max_ngram": ("max_ngram", 1), "width": ("width", 1), "lookup_num_draft": ("lookup.num_draft", 1),
             "suffix_depth": ("lookup.depth", 2), "hybrid_siblings": ("lookup.head_siblings", 0),
             "hybrid_sibling_depth": ("lookup.head_sibling_depth", 0)}
LOOKUPS = ("suffix", "ngram")
# the longest n-gram and suffix matched: beyond these a lookup only costs time (and memory: a suffix trie holds up to
# depth nodes per token)
MAX_NGRAM, MAX_SUFFIX_DEPTH = 64, 256
MAX_SIBLINGS = 64  # a hybrid's head's leaves beside one chain token
# Options that count tokens of one verification pass: none can exceed the target's context (its positions).
_IN_CONTEXT = ("num_draft", "tree_depth", "tree_total_tokens", "lookup_num_draft")
# Candidates a tree ranks per pass: top_k at depth 1, then top_k**2 per level (every kept beam's top_k children),
# each a token, parent and score in Python lists (~100 bytes) sorted at the end: 2**20 is ~100 MB and about a second
# per pass. EAGLE-2's trees (depth 5-6, top_k 8-10) rank a few thousand; tree.depth=100000 would rank 6.4M.
MAX_TREE_CANDIDATES = 2**20


def check_options(chain: bool = True, context: Optional[int] = None, **options) -> None:
    """One-line UserError for drafter options no drafter can honour (a draft of 0 tokens, a tree of depth 0,
    an empty n-gram range): they would otherwise run silently as plain decoding or fail deep in a drafter. Also for
    sizes no pass can use: a tree ranking more than MAX_TREE_CANDIDATES, and, with the target's `context` (its
    positions; build_drafter passes it), a draft, tree depth or tree longer than it. Tree options are checked only
    for trees (chain=False)."""
    for key, (name, least) in _AT_LEAST.items():
        value = options.get(key)
        if value is None or (key.startswith("tree_") and chain):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"{name} must be >= {least} (got {value})")
        if key in _IN_CONTEXT and context is not None and value > context:
            raise UserError(f"{name}={value} is more than the target's context of {context} positions: no pass can "
                            f"verify that many tokens; pass {name} <= {context}")
    depth, top_k = options.get("tree_depth"), options.get("tree_top_k")
    if not chain and depth is not None and top_k is not None and top_k + (depth - 1) * top_k**2 > MAX_TREE_CANDIDATES:
        raise UserError(f"tree.depth={depth} with tree.top_k={top_k} ranks {top_k + (depth - 1) * top_k**2} candidate "
                        f"tokens per pass (top_k + (depth - 1) * top_k^2), more than {MAX_TREE_CANDIDATES}; lower "
                        "tree.depth or tree.top_k (EAGLE-2 drafts depth 5-6, top_k 8-10)")
    lo, hi = options.get("min_ngram"), options.get("max_ngram")
    if lo is not None and hi is not None and hi < lo:
        raise UserError(f"max_ngram ({hi}) must be >= min_ngram ({lo})")
    if hi is not None and not isinstance(hi, bool) and isinstance(hi, int) and hi > MAX_NGRAM:
        raise UserError(f"max_ngram must be <= {MAX_NGRAM} (got {hi})")
    depth = options.get("suffix_depth")
    if depth is not None and not isinstance(depth, bool) and isinstance(depth, int) and depth > MAX_SUFFIX_DEPTH:
        raise UserError(f"lookup.depth must be <= {MAX_SUFFIX_DEPTH} (got {depth})")
    lookup = options.get("lookup")
    if lookup is not None and lookup not in LOOKUPS:
        raise UserError(f"unknown lookup kind '{lookup}'; known: {', '.join(LOOKUPS)}")
    if options.get("hybrid_num_draft") is not None:
        check_options(num_draft=options["hybrid_num_draft"], context=context)
    if options.get("hybrid_min_confidence") is not None:
        check_options(min_confidence=options["hybrid_min_confidence"])
    siblings = options.get("hybrid_siblings")
    if isinstance(siblings, int) and siblings > MAX_SIBLINGS:
        raise UserError(f"lookup.head_siblings must be <= {MAX_SIBLINGS} (got {siblings}): each is a verification row "
                        "a pass, and a head's 3rd-likeliest token is rarely the target's")
    mode = options.get("hybrid_mode")
    if mode is not None and mode not in ("auto", "tree", "choose"):
        raise UserError(f"unknown hybrid mode '{mode}'; known: auto, tree, choose")
    for key, name in (("suffix_min_prob", "lookup.min_prob"),):
        value = options.get(key)
        if value is not None and not 0 <= value <= 1:
            raise UserError(f"{name} must be in [0, 1] (got {value})")
    if options.get("suffix_corpus") is not None:  # the whole file checked before anything loads or is written
        from selfspec.decode.drafters.corpus import read_documents

        read_documents(options["suffix_corpus"])
    alpha = options.get("suffix_alpha")
    if alpha is not None and not alpha > 0:
        raise UserError(f"lookup.alpha must be > 0 (got {alpha})")
    confidence = options.get("min_confidence")
    if confidence is not None and not 0 <= confidence <= 1:
        raise UserError(f"min_confidence must be in [0, 1] (got {confidence}); 0 always drafts full chains")


def drafter_for(drafter: Optional[str], head: Optional[str], revision: Optional[str] = None) -> str:
    """The drafter a command decodes with: the head's recorded type when `drafter` is null; `drafter=` only
    overrides, and one that cannot use the head is a one-line error (checked before the target is loaded)."""
    if drafter == "hybrid":  # the head (or draft_model=) beside a lookup
        if head is not None:
            from selfspec.heads.checkpoint import head_type

            check_hybrid_head(head_type(head, revision))
        return drafter
    if head is None:
        if drafter is None or drafter in names():  # drafters named after the head type they decode with
            raise UserError(f"{'drafter=' + drafter if drafter else 'decoding with a drafter'} needs head=<a trained "
                            f"head: folder, .safetensors/.pt file or Hub id> (its type picks the drafter), or "
                            f"drafter=ngram|suffix|draft_model|none")
        return drafter
    from selfspec.heads.checkpoint import head_type

    kind = head_type(head, revision)
    if drafter is not None and drafter != kind:
        raise UserError(f"'{head}' is a '{kind}' head and drafter={drafter} cannot decode with it; drop drafter= (the "
                        f"head picks its drafter) or pass drafter={kind}")
    return kind


def load_head_for(target, head: Any, head_type: str, revision: Optional[str] = None):
    """A head module (returned as is) or a spec (folder, .safetensors/.pt file, Hub id; `revision` pins a Hub
    id's branch, tag or commit) loaded for `target`."""
    if head is None:
        raise UserError("this drafter needs a trained head: head=<folder, .safetensors/.pt file or Hub id>")
    if not isinstance(head, str):
        return head
    try:
        from selfspec.heads.checkpoint import load_head
    except ModuleNotFoundError as e:
        if e.name != "selfspec.heads.checkpoint":  # a dependency of it is missing: say which, as Python does
            raise
        raise UserError("cannot load heads: heads/checkpoint.py is missing from this checkout") from e
    return load_head(head, target, expected_type=head_type, revision=revision)
