"""EAGLE-1/2 head: extrapolate the target's next post-norm hidden state from its current one.

    x_t   = fc(cat(embed(token_{t+1}), f_t))        # [B, T, 2H] -> [B, T, H]
    f'_t+1 = decoder_layers(x_t)                    # Llama layer(s) (layer=llama) or the target family's, no final norm
    logits = lm_head(f'_t+1)                        # the target's frozen lm_head (optionally a row subset)

The decoder stack is a base model class of transformers with `num_hidden_layers` layers and a 1-token vocabulary,
so masks, RoPE and KV caching are HF's own. Which class is the head's `layer` option (LAYERS):
  llama   (the default) LlamaModel from a LlamaConfig sized from the target (`llama_layers_config`): what vLLM,
          SGLang and llama.cpp build for an EAGLE draft of any target family, so every family's head exports.
  target  the target family's own base model class (e.g. Qwen3Model with its q/k norms) from a copy of the
          target's config; the engines have no such layer, so only Llama targets' heads of this kind export.
A head record without `layer` (every head saved before the option existed) is `target` (`recorded_layer`).
Layer 0 has no input_layernorm and the stack no final norm, as in EAGLE. The target's embedding and lm_head
are held by reference: not parameters of the head, not in its state dict, never copied.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from selfspec.core.errors import UserError
from selfspec.core.kernels import linear
from selfspec.core.target import finish_logits

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


@dataclass
class EagleConfig:
    """Schema of `draft=eagle` (Hydra group `draft/`)."""

    type: str = field(default="eagle", metadata={"help": "head type recorded in checkpoints (set by draft=eagle)"})
    num_layers: int = field(default=1, metadata={"help": "Decoder layers in the head (EAGLE uses 1)."})
    fc_bias: bool = field(default=False, metadata={"help": (
        "Bias on fc. The original EAGLE has one; vLLM's EAGLE loader builds fc without a bias and silently drops "
        "it, so the default is False (a head that serves correctly everywhere).")})
    vocab_size: Optional[int] = field(default=None, metadata={"help": (
        "Reduced draft vocabulary: logits only over the N most frequent assistant tokens of the training data (null "
        "= the target's full vocabulary). Saves most of the draft step's lm_head cost on a CPU.")})
    init_from_layer: Optional[int] = field(default=None, metadata={"help": (
        "Initialise the head's decoder layer from this target layer (null = random init). The LAST layer "
        "is a bad choice: it expects the un-normed residual stream, not post-norm features (top-1 agreement 0.02 "
        "against 0.31 after 8 minutes in an early run). With layer=llama only a target whose layer IS a Llama layer "
        "(llama, mistral) can be copied; other families are refused (their q/k norms, biases, activation or norm "
        "form have no place in it).")})
    layer: str = field(default="llama", metadata={"help": LAYER_HELP})


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


class EagleHead(nn.Module):
    head_type = "eagle"
    # methods besides forward that training calls on the head's own weights (logits reads only the target's
    # lm_head): none; under FSDP such methods gather the weights as forward does (train/loop.start_run)
    forward_methods = ()

    def __init__(self, target_config, num_layers: int = 1, fc_bias: bool = False,
                 draft_vocab: Optional[torch.Tensor] = None, layer: str = "llama"):
        super().__init__()
        self.layer = layer
        self.config = cfg = head_layers_config(target_config, num_layers, layer)
        hidden = cfg.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.model = family_model_class(cfg)(cfg)
        self.model.layers[0].input_layernorm = nn.Identity()  # EAGLE: fc output goes straight in
        self.model.norm = nn.Identity()  # no final norm: the output imitates post-norm target features
        self.model.embed_tokens.requires_grad_(False)  # unused (we pass inputs_embeds); DDP must not wait on it
        # Reduced vocabulary: draft id i <-> target id draft_vocab[i]. Saved with the head, never rebuilt.
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone(), persistent=True)
        else:
            self.draft_vocab = None
        self._shared: tuple = ()  # (embed_tokens, lm_head, config) of the target, by reference
        self._lm_rows: Optional[torch.Tensor] = None  # lm_head rows of the draft vocab (derived, not saved)

    # ------------------------------------------------------------------ binding the target's shared parts
    def bind(self, target_model) -> "EagleHead":
        """Share the target's embedding and lm_head by reference (never parameters of the head)."""
        self._shared = (target_model.get_input_embeddings(), target_model.get_output_embeddings(), target_model.config)
        self._lm_rows = None
        return self

    @property
    def embed_tokens(self) -> nn.Module:
        if not self._shared:
            raise RuntimeError("EagleHead.bind(target_model) must be called before use")
        return self._shared[0]

    def init_from_target(self, target_model, layer: int) -> None:
        """Copy one of the target's decoder layers into the head (input_layernorm stays dropped). A layer=llama head
        takes only a layer that is a Llama layer (build_eagle refuses the others): every other key must load."""
        src = target_model.get_decoder().layers[layer].state_dict()
        src = {k: v for k, v in src.items() if not k.startswith("input_layernorm")}
        result = self.model.layers[0].load_state_dict(src, strict=False)
        if self.layer == "llama" and (result.missing_keys or result.unexpected_keys):
            raise UserError(f"init_from_layer={layer}: the target's layer does not map onto the head's Llama layer "
                            f"(missing {result.missing_keys}, no place for {result.unexpected_keys})")

    # ------------------------------------------------------------------ forward
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_key_values=None, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """features f_t [B, T, H] paired with tokens x_{t+1} [B, T] -> predicted f_{t+1} [B, T, H].

        `attention_mask`: None (causal over the cache + these tokens), a 2-D padding mask, or a 4-D
        [B, 1, T, past+T] boolean mask (True = attend) for tree drafting. Uses and extends `past_key_values`.
        """
        dtype = self.fc.weight.dtype  # the head's own (fp32 master weights in training, whatever the target's)
        with torch.no_grad():
            emb = self.embed_tokens(input_ids)  # [B, T, H] frozen, in the target's dtype
        x = self.fc(torch.cat([emb.to(dtype), features.to(dtype)], dim=-1))
        out = self.model(inputs_embeds=x, position_ids=position_ids, past_key_values=past_key_values,
                         attention_mask=attention_mask, use_cache=past_key_values is not None)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T, V_draft] through the target's lm_head (restricted to the draft vocab), computed in the
        lm_head's dtype: a fp32 head meeting a bf16 target casts its hidden states once, here (the frozen weight is
        never copied to fp32; the logits come back in the target's dtype and losses take .float())."""
        lm_head, target_config = self._shared[1], self._shared[2]
        hidden = hidden.to(lm_head.weight.dtype)
        if self.draft_vocab is None:
            out = lm_head(hidden)
        else:
            if self._lm_rows is None or self._lm_rows.device != hidden.device:
                self._lm_rows = lm_head.weight.detach()[self.draft_vocab.to(lm_head.weight.device)]
            out = linear(hidden, self._lm_rows)
        return finish_logits(target_config, out)  # as the target's own: Granite's logits_scaling, Gemma's soft-cap

    def draft_token_ids(self) -> Optional[torch.Tensor]:
        """Target id of every draft id [V_draft]; None when the head drafts over the full vocabulary."""
        return self.draft_vocab

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab.to(draft_ids.device)[draft_ids]

    def head_config(self) -> dict:
        return {"type": self.head_type, "num_layers": self.config.num_hidden_layers,
                "fc_bias": self.fc.bias is not None,
                "vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel()), "layer": self.layer}


def build_eagle(target_model, num_layers: int = 1, fc_bias: bool = False, vocab_size: Optional[int] = None,
                init_from_layer: Optional[int] = None, draft_vocab: Optional[torch.Tensor] = None,
                layer: str = "llama", **_unused) -> EagleHead:
    """Fresh head for `target_model`. `draft_vocab` (ids, most frequent first) is required iff vocab_size.
    `layer`: llama or target (LAYERS); heads.checkpoint.build_head passes what a record says (none: target)."""
    check_layer(layer)
    if vocab_size is not None and (draft_vocab is None or draft_vocab.numel() != vocab_size):
        raise ValueError("a reduced draft vocabulary needs its token ids (see heads.vocab.top_tokens)")
    n = target_model.config.get_text_config().num_hidden_layers
    if init_from_layer is not None and (not isinstance(init_from_layer, int) or isinstance(init_from_layer, bool)
                                        or not 0 <= init_from_layer < n):
        raise UserError(f"init_from_layer={init_from_layer!r} is not a decoder layer of the target (0..{n - 1}); "
                        "pass one of them, or null for a random init")
    text = target_model.config.get_text_config()
    if init_from_layer is not None and layer == "llama" and (text.model_type not in LLAMA_LAYER_FAMILIES
                                                             or getattr(text, "hidden_act", None) != "silu"):
        raise UserError(f"init_from_layer with draft.layer=llama copies a target layer into a Llama layer; a "
                        f"'{text.model_type}' layer computes something else (its norms, biases, activation or "
                        f"scales have no place in it, only {', '.join(LLAMA_LAYER_FAMILIES)} layers do): pass "
                        "init_from_layer=null, or draft.layer=target")
    head = EagleHead(target_model.config, num_layers=num_layers, fc_bias=fc_bias, draft_vocab=draft_vocab,
                     layer=layer)
    if init_from_layer is not None:
        head.init_from_target(target_model, init_from_layer)
    return head.to(target_model.dtype).bind(target_model)
