"""EAGLE-1/2 head: extrapolate the target's next post-norm hidden state from its current one.

    x_t   = fc(cat(embed(token_{t+1}), f_t))        # [B, T, 2H] -> [B, T, H]
    f'_t+1 = decoder_layers(x_t)                    # Llama layer(s) (layer=llama) or the target family's, no final norm
    logits = lm_head(f'_t+1)                        # the target's frozen lm_head (optionally a row subset)

The decoder stack is heads/layers.py's (its `layer` option). Layer 0 has no input_layernorm and the stack no final
norm, as in EAGLE. The target's embedding and lm_head are held by reference: not parameters of the head, not in its
state dict, never copied.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from selfspec.core.errors import UserError
from selfspec.target.kernels import kind as kernel_kind, linear, packed_from
from selfspec.target.model import finish_logits
from selfspec.heads.layers import (LAYER_HELP, LLAMA_LAYER_FAMILIES, check_layer, family_model_class,
                                   head_layers_config)


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
    layer: str = field(default="llama", metadata={"help": (
        LAYER_HELP + " A head fine-tuned from init_from keeps its own.")})
    init_from: Optional[str] = field(default=None, metadata={"help": (
        "Fine-tune this eagle head (folder, file or Hub id): its weights, its layers and its draft vocabulary are "
        "the start point (num_layers, fc_bias, vocab_size and layer are read from it, never rebuilt from the new "
        "data). null = a fresh head.")})

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
            out = linear(hidden, self._lm_rows, packed_from=packed_from(lm_head),
                         kind=kernel_kind(lm_head))  # as the lm_head runs
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
