"""Tiny random targets for tests: one per decoder family users train drafters for (Llama 3, Qwen2/3, Qwen3-MoE,
Gemma3, Mistral, Phi-3, gpt-oss, Granite, OLMo2, SmolLM3; Qwen3-Next, which load_target refuses), each with a
byte-level tokenizer and the chat-template shape of its family. Built from a config and a seed; nothing is
downloaded. docs/targets.md says what each one runs through (tests/train/test_families.py)."""

from __future__ import annotations

import importlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec.core.errors import UserError

# Per chat-template shape: special tokens (bos, eos = end of turn, pad, extra markers) and a template of that
# shape. Gemma has no system role (folded into the first user turn) and calls the assistant "model"; Mistral has
# no generation prompt (the assistant text follows [/INST]); gpt-oss's harmony format names a channel.
_CHATS = {
    "llama": dict(
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|pad|>", extra=["<|start_header_id|>", "<|end_header_id|>"],
        template=(
            "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
            " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
        ),
    ),
    "chatml": dict(
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=["<|im_start|>"],
        template=(
            "{% if messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
            "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
    ),
    "gemma": dict(
        bos="<bos>", eos="<end_of_turn>", pad="<pad>", extra=["<start_of_turn>"],
        template=(
            "{{ bos_token }}{% set sys = '' %}{% if messages[0]['role'] == 'system' %}"
            "{% set sys = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}{% endif %}"
            "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
            "{{ '<start_of_turn>' + role + '\n' + (sys if loop.first else '') + m['content'] + '<end_of_turn>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
        ),
    ),
    "mistral": dict(
        bos="<s>", eos="</s>", pad="<pad>", extra=["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
        template=(
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' }}{% elif m['role'] == 'user' %}"
            "{{ '[INST]' + m['content'] + '[/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
        ),
    ),
    "phi3": dict(
        bos=None, eos="<|end|>", pad="<|endoftext|>", extra=["<|system|>", "<|user|>", "<|assistant|>"],
        template=(
            "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
        ),
    ),
    "harmony": dict(
        bos=None, eos="<|end|>", pad="<|endoftext|>", extra=["<|start|>", "<|message|>", "<|channel|>", "<|return|>"],
        template=(
            "{% for m in messages %}{% if m['role'] == 'assistant' %}"
            "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' }}{% else %}"
            "{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
        ),
    ),
    "granite": dict(
        bos=None, eos="<|end_of_text|>", pad="<|pad|>", extra=["<|start_of_role|>", "<|end_of_role|>"],
        template=(
            "{% for m in messages %}{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] +"
            " '<|end_of_text|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"
        ),
    ),
    "tulu": dict(
        bos=None, eos="<|endoftext|>", pad="<|pad|>", extra=["<|system|>", "<|user|>", "<|assistant|>"],
        template=(
            "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ '<|endoftext|>' }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|assistant|>\n' }}{% endif %}"
        ),
    ),
}

_LLAMA3_ROPE = {  # Llama 3.1's rope scaling, with the original context shrunk so tiny prompts cross the bands
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64}

# family (tiny:<family>) -> (chat shape, transformers module, config class, model class, config beyond the shared
# tiny sizes). Each family keeps what makes it itself: sliding windows, q/k norms, MoE routers, attention sinks,
# fused projections, multipliers, post-norm layers, NoPE layers.
_MODELS = {
    "llama": ("llama", "llama", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3": ("llama", "llama", "LlamaConfig", "LlamaForCausalLM",
               dict(tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE)),
    "qwen2": ("chatml", "qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("chatml", "qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("chatml", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       tie_word_embeddings=False)),
    # small windows, so tests see sliding-window layers at work
    "gemma3": ("gemma", "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=64, query_pre_attn_scalar=16)),
    "mistral": ("mistral", "mistral", "MistralConfig", "MistralForCausalLM",
                dict(sliding_window=64, tie_word_embeddings=False)),  # one window on every layer, no layer_types
    "phi3": ("phi3", "phi3", "Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),  # fused qkv_proj
    "gpt_oss": ("harmony", "gpt_oss", "GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                     tie_word_embeddings=False, rope_parameters={
                         "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    "granite": ("granite", "granite", "GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25,
                     logits_scaling=4.0, tie_word_embeddings=True)),
    "olmo2": ("tulu", "olmo2", "Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False)),  # post-norm
    "smollm3": ("chatml", "smollm3", "SmolLM3Config", "SmolLM3ForCausalLM",
                dict(no_rope_layer_interval=2, tie_word_embeddings=True)),  # layer 2 of 2 has no RoPE
    # builds and runs on a CPU (transformers' torch fallbacks), and is refused by load_target: its linear-attention
    # layers keep a recurrent state that rejected drafts cannot be rolled back from (target/model.py check_family)
    "qwen3_next": ("chatml", "qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                        tie_word_embeddings=False)),
}


FAMILIES = tuple(_MODELS)  # every tiny:<family>, Qwen3-Next (refused by load_target) last


def tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) plus the family's special tokens and template."""
    spec = _CHATS[_family(family)[0]]
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
    _, module, config_name, model_name, own = _family(family)
    tok = tiny_tokenizer(family)
    vocab = 64 * ((len(tok) + 63) // 64)  # round up like real vocabularies; ids past len(tok) are never produced
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        # Larger than the usual 0.02 so random logits are well separated: fp32 greedy tests then compare
        # real decisions, not near-ties that any change of kernel shape can flip.
        initializer_range=0.2,
        **own,
    )
    common.update(overrides)
    if "layer_types" in own and "layer_types" not in overrides:  # another depth keeps the family's layer pattern
        n = common["num_hidden_layers"]
        common["layer_types"] = (own["layer_types"] * n)[:n]
    lib = importlib.import_module(f"transformers.models.{module}")
    config = getattr(lib, config_name)(**common)
    config._name_or_path = f"tiny:{family}"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = getattr(lib, model_name)(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _family(family: str) -> tuple:
    if family not in _MODELS:
        raise UserError(f"unknown tiny target family '{family}'; known: {', '.join(_MODELS)}")
    return _MODELS[family]
