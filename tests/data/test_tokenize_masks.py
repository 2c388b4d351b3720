"""Token ids and loss masks with the target's chat template: the mask is exactly the assistant turns."""

import glob
import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from selfspec.data.config import DataConfig
from selfspec.data.conversations import is_heldout, load_conversations, select_split
from selfspec.data.tokenize import (
    CHATML, build_dataset, encode_conversation, end_of_turn_ids, heldout_prompts, opening_key, resolve_chat_template,
)
from selfspec.core.errors import UserError
from selfspec.target.tiny import tiny_tokenizer

FAMILIES = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "gemma3": "<end_of_turn>"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "Hello, héllo 你好!"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "Sure.\nTwo lines"},
]


def masked_runs(tokenizer, ids, mask):
    """The decoded text of each contiguous run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]


def check_masks(tokenizer, messages, end_of_turn):
    template = resolve_chat_template(tokenizer, None)
    ids, mask = encode_conversation(messages, tokenizer, template)
    assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])  # same ids as serving
    assert set(mask) <= {0, 1} and len(mask) == len(ids)
    answers = [m["content"] + end_of_turn for m in messages if m["role"] == "assistant"]
    assert masked_runs(tokenizer, ids, mask) == answers


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_is_exactly_assistant_text_and_end_of_turn(family):
    tokenizer = tiny_tokenizer(family)
    check_masks(tokenizer, CONVERSATION, FAMILIES[family])  # with a system turn (gemma folds it into the user's)
    check_masks(tokenizer, CONVERSATION[1:], FAMILIES[family])  # qwen2 injects its default system prompt
    template = resolve_chat_template(tokenizer, None)
    assert end_of_turn_ids(tokenizer, template) == [tokenizer.convert_tokens_to_ids(FAMILIES[family])]


text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=30)


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), system=st.one_of(st.none(), text),
       turns=st.lists(st.tuples(text, text), min_size=1, max_size=3))
def test_mask_property_any_text(family, system, turns):
    messages = [{"role": "system", "content": system}] if system is not None else []
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    check_masks(tiny_tokenizer(family), messages, FAMILIES[family])


def test_truncation_and_fallbacks():
    tokenizer = tiny_tokenizer("qwen2")
    template = resolve_chat_template(tokenizer, None)
    ids, mask = encode_conversation(CONVERSATION, tokenizer, template, max_length=60)
    full_ids, full_mask = encode_conversation(CONVERSATION, tokenizer, template)
    assert (ids, mask) == (full_ids[:60], full_mask[:60]) and 0 < sum(mask) < sum(full_mask)
    long_question = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y"}]
    with pytest.raises(Exception, match="no_assistant_tokens_within_max_length"):
        encode_conversation(long_question, tokenizer, template, max_length=50)
    tokenizer.chat_template = None
    with pytest.raises(UserError, match="no chat template.*chatml"):
        resolve_chat_template(tokenizer, None)
    assert resolve_chat_template(tokenizer, "chatml") == CHATML
    with pytest.raises(UserError, match="neither 'chatml' nor a Jinja template"):
        resolve_chat_template(tokenizer, "llama3")


def data_cfg(tmp_path, **kw):
    return DataConfig(**{"path": "synthetic", "cache_dir": str(tmp_path / "cache"), "max_length": 256,
                         "heldout_fraction": 0.1, **kw})


def test_build_dataset_splits_columns_and_cache(tmp_path):
    tokenizer = tiny_tokenizer("llama")
    cfg = data_cfg(tmp_path)
    train, heldout = build_dataset(cfg, tokenizer, "train"), build_dataset(cfg, tokenizer, "heldout")
    assert train.column_names == ["id", "input_ids", "loss_mask"]
    assert len(train) + len(heldout) == 200 and set(train["id"]).isdisjoint(heldout["id"])
    row = train[0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) <= 256 and set(row["loss_mask"]) == {0, 1}
    assert row["input_ids"][0] == tokenizer.bos_token_id and row["input_ids"][1] != tokenizer.bos_token_id
    again = build_dataset(cfg, tokenizer, "train")  # from the on-disk cache
    assert again["input_ids"] == train["input_ids"] and again.cache_files == train.cache_files
    two = build_dataset(data_cfg(tmp_path / "p2", num_proc=2), tokenizer, "train")
    assert two["input_ids"] == train["input_ids"]
    with pytest.raises(UserError, match="heldout split .* is empty"):
        build_dataset(data_cfg(tmp_path, max_conversations=3, heldout_fraction=0.001), tokenizer, "heldout")


def test_system_prompt_override_reaches_the_tokens(tmp_path):
    tokenizer = tiny_tokenizer("qwen2")
    default = build_dataset(data_cfg(tmp_path, max_conversations=5), tokenizer, "train")
    custom = build_dataset(data_cfg(tmp_path, max_conversations=5, system_prompt="Pirate."), tokenizer, "train")
    assert "You are a helpful assistant." in tokenizer.decode(default[0]["input_ids"])
    assert "<|im_start|>system\nPirate.<|im_end|>" in tokenizer.decode(custom[0]["input_ids"])


def test_heldout_prompts_are_deterministic_opening_turns(tmp_path):
    tokenizer = tiny_tokenizer("gemma3")
    cfg = data_cfg(tmp_path)
    prompts = heldout_prompts(cfg, tokenizer, 5)
    assert len(prompts) == 5 and prompts == heldout_prompts(cfg, tokenizer, 5)
    for prompt in prompts:
        assert prompt[-1]["role"] == "user" and all(m["role"] in ("system", "user") for m in prompt)
    # Every held-out conversation whose opening is new (synthetic data repeat questions) and not too long.
    conversations = load_conversations(cfg)[0]
    heldout = select_split(conversations, cfg, "heldout")
    train = {opening_key(m) for m in select_split(conversations, cfg, "train")["messages"]}
    fresh = {opening_key(m) for m in heldout["messages"]} - train
    everything = heldout_prompts(cfg, tokenizer, 1000)
    assert 0 < len(everything) == len(fresh) < len(heldout)
    assert len({opening_key(p) for p in everything}) == len(everything)


def test_heldout_prompts_that_open_a_training_conversation_are_passed_over(tmp_path):
    """ShareGPT repeats openings ("hi", "continue") under other ids: such a prompt is not held out, even when it
    differs in case or spacing, even when only a part of the file beyond data.max_conversations trains on it."""
    ids = [f"c{i}" for i in range(400)]
    held, train = [i for i in ids if is_heldout(i, 0.5)], [i for i in ids if not is_heldout(i, 0.5)]

    def conv(cid, question):
        return {"id": cid, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "ok"}]}

    records = [conv(held[0], "hi"), conv(held[1], "What is  the capital of France?"), conv(held[2], "continue"),
               conv(held[3], "fresh one"), conv(held[4], "Fresh one"), conv(train[0], "HI"),
               conv(held[5], "another fresh one")]
    records += [conv(t, f"filler {k}") for k, t in enumerate(train[1:20])]
    records += [conv(train[20], "what is the capital of   france?"), conv(train[21], "continue")]
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    tokenizer = tiny_tokenizer("llama")
    questions = lambda cfg: [p[-1]["content"] for p in heldout_prompts(cfg, tokenizer, 10)]  # noqa: E731
    cfg = data_cfg(tmp_path, path=str(path), heldout_fraction=0.5)
    assert questions(cfg) == ["fresh one", "another fresh one"]
    # Reading only the first 7 records: the later training conversations still rule out "continue" and France.
    assert questions(data_cfg(tmp_path, path=str(path), heldout_fraction=0.5, max_conversations=7)) == \
        ["fresh one", "another fresh one"]
    with pytest.raises(UserError, match="no held-out prompts .* do not also open a training conversation"):
        heldout_prompts(data_cfg(tmp_path, path=str(path), heldout_fraction=0.5, max_conversations=3), tokenizer, 5)


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from selfspec.target.model import cache_root

    cached = sorted(glob.glob(str(cache_root() / "targets" / "SmolLM2-135M-Instruct*" / "tokenizer.json")))
    if cached:  # the converted target's folder: ~1 s
        return AutoTokenizer.from_pretrained(os.path.dirname(cached[-1]))
    from selfspec.target.model import EMBEDDED, _package_file

    gguf = _package_file(EMBEDDED["smollm2-135m"][1])  # straight from the GGUF: ~20 s
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.mark.slow
def test_smollm2_masks_and_default_system_prompt():
    tokenizer = smollm2_tokenizer()
    check_masks(tokenizer, CONVERSATION, "<|im_end|>")
    check_masks(tokenizer, CONVERSATION[1:], "<|im_end|>")
    ids, _ = encode_conversation(CONVERSATION[1:], tokenizer, resolve_chat_template(tokenizer, None))
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)
    assert end_of_turn_ids(tokenizer, resolve_chat_template(tokenizer, None)) == [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.slow
def test_smollm2_masks_on_real_sharegpt_conversations():
    from selfspec.data.conversations import _embedded_sharegpt, _json_array, normalize

    tokenizer = smollm2_tokenizer()
    checked = 0
    for _, record in _json_array(str(_embedded_sharegpt())):
        _, messages, skip = normalize(record)
        if not skip:
            check_masks(tokenizer, messages, "<|im_end|>")
            checked += 1
        if checked == 200:
            break
