"""The decoder-layer toolkit every head shares, and any slice of a frozen target's decoder run through its own
modules.

A head's decoder stack is a base model class of transformers with `num_hidden_layers` layers and a 1-token vocabulary,
so masks, RoPE and KV caching are HF's own. Which class is the head's `layer` option (LAYERS):
  llama   (the default) LlamaModel from a LlamaConfig sized from the target (`llama_layers_config`): what vLLM,
          SGLang and llama.cpp build for an EAGLE draft of any target family, so every family's head exports.
  target  the target family's own base model class (e.g. Qwen3Model with its q/k norms) from a copy of the
          target's config; the engines have no such layer, so only Llama targets' heads of this kind export.
A head record without `layer` (every head saved before the option existed) is `target` (`recorded_layer`).

`run_layers` runs layers [start, end) of the target itself: LayerSkip's exit drafts with layers [0, E), decode/kv.py
verifies from layer E on, methods/layerskip/exit_sweep.py reads every exit.
"""

from __future__ import annotations

import copy
import inspect

import torch

from selfspec.core.errors import UserError

# The head's decoder layer kinds (EagleConfig.layer, Eagle3Config.layer): see the module docstring.
LAYERS = ("llama", "target")
LAYER_HELP = (
    "The head's decoder layer: 'llama' (default) = transformers' Llama layer sized from the target (heads, q/kv "
    "heads, head_dim, MLP width, RoPE, norm eps), what vLLM, SGLang and llama.cpp build for an EAGLE draft of any "
    "target family, so every family's head exports; 'target' = the target family's own layer (e.g. Qwen3's, with "
    "its q/k norms), which the engines cannot load for non-Llama families. A saved head without the key is 'target'.")
# Families whose decoder layer computes what a Llama layer computes (same weights, same function), so one of their
# layers can initialise a layer=llama head (init_from_layer). Mistral's differs only by its sliding window, which
# head layers never use.
LLAMA_LAYER_FAMILIES = ("llama", "mistral")
# RoPE types transformers' Llama layer and the engines' Llama drafts compute (ROPE_INIT_FUNCTIONS; vLLM get_rope).
LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def check_layer(layer) -> str:
    """A head's `layer` option, or a one-line UserError listing the choices."""
    if layer not in LAYERS:
        raise UserError(f"head layer={layer!r} is not a decoder-layer kind; use one of {', '.join(LAYERS)} "
                        "(llama: the layer vLLM, SGLang and llama.cpp build for an EAGLE draft of any family)")
    return layer


def recorded_layer(head_cfg: dict) -> str:
    """The layer kind of a head record: records written before the option existed hold the target family's."""
    return head_cfg.get("layer", "target")


def family_model_class(config) -> type:
    """The base model class (e.g. LlamaModel) of the target's family, from transformers' own registry."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(config)]


def llama_layers_config(target_config, num_layers: int, vocab_size: int = 1):
    """A LlamaConfig for a layer=llama head's decoder stack, sized from the target's text config: the shapes of its
    attention and MLP (head_dim explicit: Gemma's and Qwen3's differ from hidden/heads), its RoPE and norm eps and
    context; SiLU (vLLM's Llama MLP takes nothing else), no biases, no sliding window, untied, `vocab_size` rows of
    embedding (1: the head is fed inputs_embeds; exporters pass the target's)."""
    from transformers import LlamaConfig

    text = target_config.get_text_config()
    heads = text.num_attention_heads
    cfg = LlamaConfig(
        hidden_size=text.hidden_size, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=text.intermediate_size, hidden_act="silu", attention_bias=False, mlp_bias=False,
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=text.max_position_embeddings, rope_parameters=_llama_rope(text),
        num_hidden_layers=num_layers, vocab_size=vocab_size, pad_token_id=None, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, initializer_range=getattr(text, "initializer_range", 0.02))
    cfg._attn_implementation = text._attn_implementation  # the target's kernels (eager, sdpa), as layer=target has
    return cfg


def _llama_rope(text) -> dict:
    """The target's RoPE as a Llama layer's `rope_parameters`. Gemma 3 keeps one set per layer type (local sliding
    layers 10k, global layers 1M, scaled on the larger models): a head layer attends to the whole context like the
    global layers, so it takes theirs (EAGLE-3's target-kind layer asks its rotary for "full_attention" too).
    A RoPE type Llama has not is refused; partial rotation is dropped (the Llama layer rotates the whole head)."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = dict(rope["full_attention"])
    rope.pop("partial_rotary_factor", None)
    rope.setdefault("rope_theta", getattr(text, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] not in LLAMA_ROPE_TYPES:
        raise UserError(f"head layer=llama: the target's RoPE type '{rope['rope_type']}' has no Llama equivalent "
                        f"({', '.join(LLAMA_ROPE_TYPES)}); train with draft.layer=target")
    return rope


def head_layers_config(target_config, num_layers: int, layer: str = "target"):
    """The config of a head's decoder stack: a LlamaConfig sized from the target (layer=llama), else the
    target family's own config (layer=target), `num_layers` deep. EAGLE-1 and EAGLE-3 heads build their layers
    from it."""
    if check_layer(layer) == "llama":
        return llama_layers_config(target_config, num_layers)
    return _family_layers_config(target_config, num_layers)


def _family_layers_config(target_config, num_layers: int):
    """The config of a head's own decoder stack: the target family's, `num_layers` deep, every layer attending to
    the whole context (no sliding window in any family's spelling), no embedding of its own (1 row: the head is fed
    inputs_embeds), untied. EAGLE-1 and EAGLE-3 heads build their layers from it."""
    cfg = copy.deepcopy(target_config.get_text_config())
    cfg.num_hidden_layers = num_layers
    cfg.vocab_size, cfg.pad_token_id = 1, None
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * num_layers
    if hasattr(cfg, "use_sliding_window"):
        cfg.use_sliding_window = False
    if getattr(cfg, "layer_types", None) is None and getattr(cfg, "sliding_window", None) is not None:
        cfg.sliding_window = None  # Mistral, Phi-3: without layer_types HF slides every layer when it is set
    cfg.tie_word_embeddings = False
    return cfg


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


def _rope(decoder, hidden: torch.Tensor, position_ids: torch.Tensor, kinds) -> dict:
    """{layer type: (cos, sin)} from the target's own rotary embedding (Gemma3 has one per attention type)."""
    takes_type = "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters
    return {t: decoder.rotary_emb(hidden, position_ids, t) if takes_type else decoder.rotary_emb(hidden, position_ids)
            for t in kinds}


def _hf_masks(config, hidden, attention_mask, cache, position_ids, kinds) -> dict:
    """HF's own masks per attention type (training: causal + optional 2-D padding mask)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=cache,
              position_ids=position_ids)
    return {t: create_sliding_window_causal_mask(**kw) if t == "sliding_attention" else create_causal_mask(**kw)
            for t in kinds}


def run_layers(model, hidden: torch.Tensor, start: int, end: int, position_ids: torch.Tensor, cache=None,
               attention_mask=None, return_all: bool = False):
    """Decoder layers [start, end) of a *ForCausalLM over the residual stream `hidden` [B, T, H] -> [B, T, H].

    Uses the model's own layer modules and rotary embedding; extends `cache` (a DynamicCache) for those layers.
    attention_mask: a prepared mask (a [B, 1, T, S] tensor, or {layer type: mask} as decode/kv.py builds them;
    S = the cached length of THESE layers + T), or None / a 2-D padding mask [B, T] (HF's causal masks are built).
    return_all: the list [hidden, after layer start, ..., after layer end-1] instead of the last state.
    """
    decoder = model.get_decoder()
    config = decoder.config
    types = layer_types(config)
    kinds = set(types[start:end])
    states = [hidden]
    if not kinds:
        return states if return_all else hidden
    if attention_mask is None or (torch.is_tensor(attention_mask) and attention_mask.dim() == 2):
        masks = _hf_masks(config, hidden, attention_mask, cache, position_ids, kinds)
    elif isinstance(attention_mask, dict):
        masks = attention_mask
    else:
        masks = {t: attention_mask for t in kinds}
    rope = _rope(decoder, hidden, position_ids, kinds)
    for i in range(start, end):
        out = decoder.layers[i](hidden, attention_mask=masks[types[i]], position_embeddings=rope[types[i]],
                                position_ids=position_ids, past_key_values=cache, use_cache=cache is not None)
        hidden = out[0] if isinstance(out, tuple) else out
        states.append(hidden)
    return states if return_all else hidden
