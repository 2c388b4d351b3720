"""Conversations -> token ids and a loss mask with the TARGET's own chat template (the one used at serving time).

The mask covers exactly the assistant turns: each turn's text plus the template's end-of-turn token
(`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), never the role header before it nor the newline after it.
It is found the generic way, so any template works (default system prompts, Gemma's system folding):

  1. render the conversation up to turn i with the generation prompt: the assistant text starts where it ends;
  2. render it through turn i: the turn ends there, minus trailing whitespace (the newline after end-of-turn);
  3. tokenize the full rendering with character offsets and mask the tokens that start inside those spans.

The full rendering is tokenized exactly as `apply_chat_template(tokenize=True)` does it (special tokens parsed,
`add_special_tokens=False`, so no second BOS), so training sees the same ids as serving.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
from collections import Counter
from typing import Any, Optional

from selfspec.core.cli import read_once
from selfspec.core.errors import UserError

from selfspec.data.config import DataConfig
from selfspec.data.conversations import load_conversations, select_split

TOKENIZE_VERSION = 2  # bump when encoding changes: it is part of the on-disk cache key
# The ChatML fallback (data.chat_template=chatml) for targets without a template, e.g. base models.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class SkipConversation(Exception):
    """This conversation cannot be encoded; the message is the reason counted in the stats."""


# ------------------------------------------------------------------------------------------------ public API


def build_dataset(cfg: DataConfig, tokenizer, split: str, context: Optional[int] = None):
    """The `split` ("train" or "heldout") as a Dataset with columns id, input_ids, loss_mask (0/1). `context`: the
    target's positions (None: the tokenizer's model_max_length, when it states one); data.max_length above it
    is refused before anything is read. `cfg` (the composed `data.*` or a DataConfig) is read once, here."""
    cfg = read_once(cfg, DataConfig)
    check_max_length(cfg.max_length, context if context is not None else tokenizer_context(tokenizer))
    conversations, stats = load_conversations(cfg)
    tokens, skipped = tokenize_conversations(select_split(conversations, cfg, split), tokenizer, cfg)
    if len(tokens) == 0:
        raise UserError(f"the {split} split of {stats['source']} is empty after filtering (skipped while reading: "
                        f"{stats['skipped'] or 'none'}; while tokenizing: {dict(skipped) or 'none'}); "
                        + ("raise data.heldout_fraction or data.max_conversations" if split == "heldout" else
                           "check data.path and data.max_length"))
    if skipped:
        print(f"[selfspec] {split}: {len(tokens)} sequences; skipped {dict(skipped)}", flush=True)
    return tokens


def tokenize_conversations(conversations, tokenizer, cfg: DataConfig):
    """Dataset(id, messages) -> (Dataset(id, input_ids, loss_mask), Counter of skip reasons). Cached on disk."""
    import datasets

    template = resolve_chat_template(tokenizer, cfg.chat_template)
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("data tokenisation needs a fast (Rust) tokenizer for character offsets; "
                        f"{type(tokenizer).__name__} is not one")
    # An explicit cache key: datasets cannot always hash a tokenizer, and then it would silently not cache.
    key = json.dumps({"source": conversations._fingerprint, "tokenizer": tokenizer_signature(tokenizer),
                      "template": template, "max_length": cfg.max_length, "version": TOKENIZE_VERSION})
    features = datasets.Features({
        "id": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "skip": datasets.Value("string"),
    })
    if len(conversations) == 0:  # map() on no rows would not even add the new columns
        empty = datasets.Dataset.from_dict({k: [] for k in features}, features=features)
        return empty.remove_columns("skip"), Counter()
    encoded = conversations.map(
        _encode_batch, batched=True, batch_size=64, remove_columns=conversations.column_names, features=features,
        fn_kwargs=dict(tokenizer=tokenizer, template=template, max_length=cfg.max_length),
        num_proc=cfg.num_proc if cfg.num_proc > 1 and len(conversations) >= 2 * cfg.num_proc else None,
        new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32], desc="tokenizing",
    )
    skipped = Counter(encoded["skip"])
    skipped.pop("", None)
    if skipped:
        encoded = encoded.filter(lambda skip: skip == "", input_columns="skip")
    return encoded.remove_columns("skip"), skipped


def check_max_length(max_length: int, context: Optional[int]) -> None:
    """data.max_length must be >= 1 and fit the target's `context` (positions; None: unknown). A longer sequence
    would be trained or decoded past the positions the target has: an index error, or silently wrong features."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise UserError(f"data.max_length must be >= 1 (got {max_length})")
    if context is not None and max_length > context:
        raise UserError(f"data.max_length={max_length} exceeds the target's context of {context} positions; "
                        f"set data.max_length={context} or less")


def tokenizer_context(tokenizer) -> Optional[int]:
    """The context a tokenizer states (model_max_length), or None where it states none (transformers then holds
    a huge placeholder)."""
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < 10**8 else None


def heldout_prompts(cfg: DataConfig, tokenizer, n: int, context: Optional[int] = None) -> list[list[dict[str, str]]]:
    """The opening turns (system if any, then the first user turn) of the first n held-out conversations, as
    chat `messages` lists for decode benchmarks and evaluation. Deterministic.

    data.max_length must fit `context`, as in build_dataset. Passed over: prompts longer than data.max_length
    tokens, and prompts that are not really held out. ShareGPT
    repeats opening turns ("hi", "continue", ...) under different conversation ids; when the training data are
    the target's own answers, a held-out "hi" is then a training sequence. So a prompt whose opening turns,
    compared without case and whitespace, open any training conversation of the whole source (every
    data.max_conversations, data.match and data.skip_conversations reads the same file), or an earlier held-out
    prompt, is skipped. `cfg` (the composed `data.*` or a DataConfig) is read once, here.
    """
    cfg = read_once(cfg, DataConfig)
    check_max_length(cfg.max_length, context if context is not None else tokenizer_context(tokenizer))
    conversations, stats = load_conversations(cfg)
    heldout = select_split(conversations, cfg, "heldout")
    whole = dict(max_conversations=None, match=None, skip_conversations=0)  # every conversation of the source
    if all(getattr(cfg, k) == v for k, v in whole.items()):
        everything = conversations
    else:
        everything = load_conversations(dataclasses.replace(cfg, **whole))[0]
    seen = {opening_key(m) for m in select_split(everything, cfg, "train")["messages"]}
    template = resolve_chat_template(tokenizer, cfg.chat_template)
    prompts = []
    for row in heldout:
        prompt = opening_turns(row["messages"])
        key = opening_key(prompt)
        if key in seen:
            continue
        seen.add(key)
        text = tokenizer.apply_chat_template(prompt, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= cfg.max_length:
            prompts.append(prompt)
        if len(prompts) == n:
            break
    if not prompts:
        raise UserError(f"no held-out prompts in {stats['source']} that do not also open a training conversation; "
                        "raise data.heldout_fraction or data.max_conversations")
    return prompts


def opening_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system turn if any, then the first user turn."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first_user + 1]


def opening_key(messages: list[dict[str, str]]) -> tuple[tuple[str, str], ...]:
    """What makes two conversations open the same way: their opening turns without case or spacing."""
    return tuple((m["role"], " ".join(m["content"].split()).casefold()) for m in opening_turns(messages))


def encode_conversation(messages: list[dict[str, str]], tokenizer, template: str,
                        max_length: Optional[int] = None) -> tuple[list[int], list[int]]:
    """-> (input_ids, loss_mask) for one conversation; raises SkipConversation(reason)."""
    text, spans = assistant_spans(messages, tokenizer, template)
    # Truncating here equals cutting the full ids (no special tokens are added at the end) and is cheaper.
    cut = dict(truncation=True, max_length=max_length) if max_length is not None else {}
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, **cut)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    starts = [s for s, _ in spans]
    mask = []
    for tok_start, _ in offsets:
        k = bisect.bisect_right(starts, tok_start) - 1  # the last span starting at or before this token
        mask.append(int(k >= 0 and tok_start < spans[k][1]))
    if not any(mask):
        raise SkipConversation("no_assistant_tokens_within_max_length")
    return list(ids), mask


def assistant_spans(messages: list[dict[str, str]], tokenizer, template: str) -> tuple[str, list[tuple[int, int]]]:
    """-> (the rendered conversation, [(start, end) character span of each assistant turn + its end-of-turn])."""

    def render(msgs, generation_prompt):
        try:
            return tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as e:  # templates raise jinja errors for shapes they refuse (e.g. roles not alternating)
            raise SkipConversation("template_error") from e

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)  # ... up to the assistant header, e.g. "<|im_start|>assistant\n"
        through = render(messages[: i + 1], False)  # ... through "<|im_end|>\n"
        if not (through.startswith(before) and text.startswith(through)):
            # A template that renders earlier turns differently once later turns exist (e.g. one that strips
            # reasoning from history): the rendered prefix would not be what the model saw.
            raise SkipConversation("template_not_prefix_stable")
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def resolve_chat_template(tokenizer, chat_template: Optional[str]) -> str:
    """data.chat_template -> the Jinja template to use (see DataConfig.chat_template)."""
    if chat_template is None:
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates: the default one
            own = own.get("default")
        if not own:
            raise UserError(f"the target's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat "
                            "template; set data.chat_template=chatml (or a Jinja template) to use a fallback, "
                            "and serve with the same one")
        return own
    if chat_template == "chatml":
        return CHATML
    if "{%" not in chat_template and "{{" not in chat_template:
        raise UserError(f"data.chat_template '{chat_template[:40]}' is neither 'chatml' nor a Jinja template")
    check_renders(tokenizer, chat_template)
    return chat_template


def check_renders(tokenizer, template: str) -> None:
    """A template of the user's renders a user/assistant exchange, or its Jinja error is the one line (else every
    conversation would be skipped as template_error, and the split called empty after filtering)."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
    except Exception as e:  # jinja2's TemplateSyntaxError / UndefinedError, or the template's own raise_exception
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise UserError(f"data.chat_template does not render a user/assistant exchange: {type(e).__name__}{line}: "
                        f"{str(e).splitlines()[0] if str(e) else '?'}; fix the template or use "
                        "data.chat_template=chatml") from e


def end_of_turn_ids(tokenizer, template: str) -> list[int]:
    """Token ids that end an assistant turn: the template's end-of-turn token (found by rendering a probe
    conversation) plus the tokenizer's eos. Generation stops at any of them."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    text, spans = assistant_spans(probe, tokenizer, template)
    start, end = spans[0]
    tail = tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(tokenizer.all_special_ids)
    ids = [tail[-1]] if len(tail) > 1 and tail[-1] in added else []  # a marker spelled in plain text is no stop
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def tokenizer_signature(tokenizer) -> str:
    """A short hash that changes when the tokenizer's vocabulary, rules or special tokens change."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Truncation and padding are call-time state that the Rust tokenizer keeps between calls: not identity.
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        body = json.dumps(state, sort_keys=True)
    else:
        body = repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------- helpers


def _encode_batch(batch: dict[str, list[Any]], tokenizer, template: str, max_length: int) -> dict[str, list[Any]]:
    out = {"id": [], "input_ids": [], "loss_mask": [], "skip": []}
    for conv_id, messages in zip(batch["id"], batch["messages"]):
        try:
            ids, mask, skip = *encode_conversation(messages, tokenizer, template, max_length), ""
        except SkipConversation as e:
            ids, mask, skip = [], [], str(e)
        out["id"].append(conv_id)
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["skip"].append(skip)
    return out
