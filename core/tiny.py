"""Tiny random targets for tests: Llama, Qwen2 and Gemma3 families with byte-level tokenizers and each
family's own chat-template shape. Built from a config and a seed; nothing is downloaded."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec.core.errors import UserError

# Per family: special tokens (bos, eos = end of turn, pad, extra markers) and a chat template of that
# family's shape. Gemma has no system role (folded into the first user turn) and calls the assistant "model".
_FAMILIES = {
    "llama": dict(
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|pad|>", extra=["<|start_header_id|>", "<|end_header_id|>"],
        template=(
            "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
            " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
        ),
    ),
    "qwen2": dict(
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=["<|im_start|>"],
        template=(
            "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
            "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
    ),
    "gemma3": dict(
        bos="<bos>", eos="<end_of_turn>", pad="<pad>", extra=["<start_of_turn>"],
        template=(
            "{{ bos_token }}{% set sys = '' %}{% if messages[0]['role'] == 'system' %}"
            "{% set sys = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}{% endif %}"
            "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
            "{{ '<start_of_turn>' + role + '\n' + (sys if loop.first else '') + m['content'] + '<end_of_turn>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
        ),
    ),
}


def tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) plus the family's special tokens and template."""
    spec = _family(family)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in (spec["bos"], spec["eos"], spec["pad"], *spec["extra"]) if t]
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], pad_token=spec["pad"],
        chat_template=spec["template"], model_max_length=512,
    )


def build_tiny_target(family: str, seed: int = 0, **overrides):
    """Random model of `family` sized for tests (hidden 64, 2 layers). Same seed -> same weights."""
    tok = tiny_tokenizer(family)
    vocab = 64 * ((len(tok) + 63) // 64)  # round up like real vocabularies; ids past len(tok) are never produced
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        # Larger than the usual 0.02 so random logits are well separated: fp32 greedy tests then compare
        # real decisions, not near-ties that any change of kernel shape can flip.
        initializer_range=0.2,
    )
    common.update(overrides)
    if family == "llama":
        from transformers import LlamaConfig as Config, LlamaForCausalLM as Model

        common.setdefault("tie_word_embeddings", True)
    elif family == "qwen2":
        from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model

        common.setdefault("tie_word_embeddings", False)
    else:
        from transformers import Gemma3ForCausalLM as Model, Gemma3TextConfig as Config

        common.setdefault("head_dim", 16)
        common.setdefault("sliding_window", 64)  # small, so tests see sliding-window layers at work
        common.setdefault("query_pre_attn_scalar", 16)
    config = Config(**common)
    config._name_or_path = f"tiny:{family}"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Model(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _family(family: str) -> dict:
    if family not in _FAMILIES:
        raise UserError(f"unknown tiny target family '{family}'; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[family]
