"""EAGLE-3 head: draft from three fused target layers, then from its own output, over a reduced vocabulary.

    step 0:  h = fc(cat(A_lo, A_mid, A_hi))               # [B, T, 3H] -> [B, T, H], target aux states
    step j:  h = the head's own pre-norm output of step j-1 # [B, T, H]
    x   = cat(input_layernorm(embed(token)), hidden_norm(h))    # [B, T, 2H]: q/k/v project from 2H
    out = h + attn(x);  out = out + mlp(post_attention_layernorm(out))   # residual = pre-norm h
    logits = lm_head(norm(out))                              # the head's OWN lm_head [V_draft, H]
    `out` (pre-norm) is what the next step takes as h.

Aux layer id k is HF `output_hidden_states[k]`: the un-normed residual stream after k decoder layers (0 = the
embedding output; L would be the post-norm output, so ids stay in [0, L-1]); the same convention as vLLM /
speculators `eagle_aux_hidden_state_layer_ids`. Default {2, L//2, L-3}, clamped into [1, L-1] for shallow
targets. `head.aux_states(target_out.hidden_states)` picks and concatenates them.

The decoder layer is a Llama layer sized from the target (layer=llama, the default: what vLLM, SGLang and
llama.cpp load for every family) or the target family's own (layer=target; heads/layers.py builds both configs), with
q/k/v (Phi-3: the fused qkv) widened to 2H and a `hidden_norm` added; our short forward calls its submodules in the
layer's residual order (pre-norm; Gemma's sandwich; OLMo2's post-norm, which gets an input norm here), with its
rotary embedding and HF's attention functions, masks and DynamicCache. The target's
embedding is held by reference (frozen, not saved).

Draft vocabulary: `d2t` int64 [V_draft] (target id = draft id + d2t[draft id]) and `t2d` bool [V_target]
(True for target ids the draft can emit; both made by heads.vocab.vocab_maps) are buffers saved with the head and
never rebuilt: a checkpoint's mapping is passed back into `build_eagle3` (heads.checkpoint.load_head) and kept
when fine-tuning.

Decoding with the head (greedy chain; trees pass a 4-D mask instead of the default causal one):

    cache = DynamicCache()
    # prefill: the target ran over x_0..x_{n-1} with output_hidden_states=True and committed x_n.
    h = head(head.aux_states(out.hidden_states), x[:, 1:n+1], pos=[0..n-1], past_key_values=cache)
    d_1 = head.to_target_ids(head.logits(h[:, -1:]).argmax(-1))          # drafts x_{n+1}
    h = head(h[:, -1:], d_1, pos=[n], past_key_values=cache)             # step 1 -> drafts x_{n+2}; step j at n+j-1
    ...
    # The target verifies x_n, d_1..d_k at positions n..n+k (output_hidden_states=True), accepts a drafts and
    # commits a bonus token b. Crop the head's cache back to its n step-0 entries (transformers 5 only
    # accepts `cache.crop(-m)`, m = the entries drafting added), then run step 0 on the target's aux states of
    # the ACCEPTED positions n..n+a only (the old bonus x_n and the a accepted drafts, never a rejected one),
    # each paired with the NEXT committed token (d_1..d_a, b), at positions n..n+a:
    h = head(head.aux_states(verify_out.hidden_states)[:, :a+1], [d_1..d_a, b], pos=[n..n+a], past_key_values=cache)
    # h[:, -1:] drafts the next round as above (its step 1 sits at position n+a+1).

Step 0 over a pair (A_u, x_{u+1}) sits at position u; draft step j of the chain started at u sits at u + j and
attends to step-0 keys <= u plus its own chain (eval/acceptance.rollout_mask is that pattern for all u at once).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from selfspec.heads.layers import LAYER_HELP, check_layer, family_model_class, head_layers_config
from selfspec.heads.vocab import draft_to_target, vocab_maps
from selfspec.core.errors import UserError


@dataclass
class Eagle3Config:
    """Schema of `draft=eagle3` (Hydra group `draft/`)."""

    type: str = field(default="eagle3", metadata={"help": "head type recorded in checkpoints (set by draft=eagle3)"})
    aux_layers: Optional[list[int]] = field(default=None, metadata={"help": (
        "Target layers whose un-normed outputs are fused (HF hidden_states ids, each in [0, L-1]); null = the "
        "EAGLE-3 default {2, L//2, L-3}, clamped into [1, L-1].")})
    vocab_size: Optional[int] = field(default=8192, metadata={"help": (
        "Draft vocabulary: the N most frequent assistant tokens of the training data (clamped to the target's "
        "vocabulary; null = the full vocabulary). EAGLE-3 uses 32k for 8B and 16k for 0.5B targets.")})
    init_from: Optional[str] = field(default=None, metadata={"help": (
        "Fine-tune this eagle3 head (folder, file or Hub id): its weights AND its d2t/t2d mapping are the start "
        "point; the mapping is never rebuilt from the new data. null = a fresh head.")})
    layer: str = field(default="llama", metadata={"help": (
        LAYER_HELP + " A head fine-tuned from init_from keeps its own.")})


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's {2, L//2, L-3}, clamped into [1, L-1] (a 2-layer test target gets [1, 1, 1])."""
    if num_layers < 2:  # hidden_states[L] is post-norm: a 1-layer target has no un-normed residual stream to fuse
        raise UserError(f"an EAGLE-3 head fuses residual streams of layers 1..L-1: this target has {num_layers} "
                        "layer(s)")
    top = num_layers - 1
    return [min(max(k, 1), top) for k in (2, num_layers // 2, num_layers - 3)]


class Eagle3Head(nn.Module):
    head_type = "eagle3"
    # methods besides forward that training calls on the head's own weights (logits: lm_head, norm); under FSDP
    # they gather the weights as forward does (train/loop.start_run)
    forward_methods = ("logits",)

    def __init__(self, target_config, aux_layers: Sequence[int], d2t: torch.Tensor, t2d: torch.Tensor,
                 layer: str = "llama", num_layers: int = 1):
        super().__init__()
        if num_layers > 1 and layer != "llama":
            raise UserError(f"a head of {num_layers} layers stacks Llama layers after its first (as vLLM's EAGLE-3 "
                            "draft does): it needs layer=llama")
        self.layer = layer
        self.config = cfg = head_layers_config(target_config, num_layers, layer)  # its 1-row embedding is dropped
        hidden = cfg.hidden_size
        self.aux_layers = [int(k) for k in aux_layers]
        self.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)  # vLLM/SGLang: no bias
        # The decoder layer, rotary embedding and final norm (Llama's or the family's), from a one-layer base model.
        base = family_model_class(cfg)(cfg)
        layer = base.layers[0]
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "qkv_proj"):  # widen to the 2H input: cat(embedding, hidden)
            if not hasattr(attn, name):  # Phi-3 fuses q/k/v into qkv_proj; the others have the three
                continue
            old = getattr(attn, name)
            new = nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None)
            nn.init.normal_(new.weight, std=cfg.initializer_range)
            if new.bias is not None:
                nn.init.zeros_(new.bias)
            setattr(attn, name, new)
        if not hasattr(layer, "input_layernorm"):  # OLMo2's layer is post-norm: EAGLE-3 still norms both inputs
            layer.input_layernorm = copy.deepcopy(layer.post_attention_layernorm)
        layer.hidden_norm = copy.deepcopy(layer.input_layernorm)  # norms h; input_layernorm norms the embedding
        # keys `layers.0.*` as in the speculators/vLLM format; layers 1.. (P-EAGLE's deeper drafts) are plain Llama
        # layers over H, as vLLM's llama_eagle3.py stacks them
        self.layers = nn.ModuleList([layer, *base.layers[1:]])
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self._rope_takes_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        self.lm_head = nn.Linear(hidden, d2t.numel(), bias=False)
        self.register_buffer("d2t", d2t.to(torch.long).clone(), persistent=True)  # [V_draft]
        self.register_buffer("t2d", t2d.to(torch.bool).clone(), persistent=True)  # [V_target]
        self._embed: tuple = ()  # the target's embedding, by reference

    # ------------------------------------------------------------------ binding the target's shared parts
    def bind(self, target_model) -> "Eagle3Head":
        """Share the target's (frozen) token embedding by reference; it is never a parameter of the head."""
        self._embed = (target_model.get_input_embeddings(),)
        return self

    @property
    def embed_tokens(self) -> nn.Module:
        if not self._embed:
            raise RuntimeError("Eagle3Head.bind(target_model) must be called before use")
        return self._embed[0]

    def init_from_target(self, target_model) -> None:
        """Start lm_head as the target's rows of the draft vocabulary, and norm as the target's final norm. A Llama
        norm scales by w where Gemma's scales by (1 + w): a layer=llama head takes the target norm's effective scale,
        read off its output on a constant vector (so any RMSNorm form converts, none loads a weight of another
        meaning)."""
        rows = target_model.get_output_embeddings().weight.detach()[self.draft_token_ids().to(target_model.device)]
        target_norm = target_model.get_decoder().norm
        with torch.no_grad():
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
            if self.layer == "target":
                self.norm.load_state_dict(target_norm.state_dict())
                return
            dtype = next(target_norm.parameters()).dtype
            ones = torch.ones(self.config.hidden_size, device=rows.device, dtype=torch.float32)
            unit = ones * torch.rsqrt(ones.pow(2).mean() + self.config.rms_norm_eps)  # a Llama norm with w = 1
            scale = target_norm(ones.to(dtype)).float() / unit  # [H]: the target norm's scale, whatever its form
            self.norm.weight.copy_(scale.to(self.norm.weight.dtype))

    # ------------------------------------------------------------------ forward
    def aux_states(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's `output_hidden_states` tuple -> the fused input of step 0: [B, T, 3H]."""
        return torch.cat([hidden_states[k] for k in self.aux_layers], dim=-1)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_key_values=None, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One draft step over T positions -> the head's pre-norm output [B, T, H].

        `hidden`: the target's aux states [B, T, 3H] (step 0, fused by fc) or the head's own previous output
        [B, T, H] (later steps), paired with `input_ids` [B, T] (the token after each position).
        `attention_mask`: None (causal over the cache + these tokens), a 2-D padding mask, or a 4-D
        [B, 1, T, past+T] boolean mask (True = attend) for unrolled/tree drafting. Extends `past_key_values`.
        """
        width = self.config.hidden_size
        hidden = hidden.to(self.fc.weight.dtype)  # the target's aux states come in the target's dtype
        if hidden.shape[-1] == self.fc.in_features:
            h = self.fc(hidden)
        elif hidden.shape[-1] == width:
            h = hidden
        else:
            raise ValueError(f"hidden width {hidden.shape[-1]}: expected {self.fc.in_features} (aux) or {width}")
        with torch.no_grad():
            emb = self.embed_tokens(input_ids).to(h.dtype)  # [B, T, H] frozen
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids)
        rope = (self.rotary_emb(h, position_ids, "full_attention") if self._rope_takes_layer_type
                else self.rotary_emb(h, position_ids))
        attend = {"position_embeddings": rope, "attention_mask": mask, "past_key_values": past_key_values,
                  "position_ids": position_ids}
        out = _first_layer(self.layers[0], h, emb, attend)
        for layer in self.layers[1:]:  # Llama layers (num_layers > 1 needs layer=llama): pre-norm residual blocks
            a, _ = layer.self_attn(hidden_states=layer.input_layernorm(out), **attend)
            out = out + a
            out = out + _states(layer.mlp(layer.post_attention_layernorm(out)))
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [B, T, H] -> draft-vocabulary logits [B, T, V_draft]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def draft_token_ids(self) -> torch.Tensor:
        """Target id of every draft id: [V_draft]."""
        return draft_to_target(self.d2t)

    def head_config(self) -> dict:
        config = {"type": self.head_type, "aux_layers": list(self.aux_layers), "vocab_size": int(self.d2t.numel()),
                  "layer": self.layer}
        if len(self.layers) > 1:  # one-layer records stay as they were
            config["num_layers"] = len(self.layers)
        return config


def _first_layer(layer, h: torch.Tensor, emb: torch.Tensor, attend: dict) -> torch.Tensor:
    """EAGLE-3's first layer: attention over cat(norm(embedding), hidden_norm(h)) [B, T, 2H], residual h, in the
    layer's residual order (pre-norm; Gemma's sandwich; OLMo2's post-norm)."""
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)  # [B, T, 2H]
    a, _ = layer.self_attn(hidden_states=x, **attend)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma-style sandwich norms around attn and mlp
        out = h + layer.post_attention_layernorm(a)
        return out + layer.post_feedforward_layernorm(_states(layer.mlp(layer.pre_feedforward_layernorm(out))))
    if hasattr(layer, "post_feedforward_layernorm"):  # OLMo2: post-norm, each output normed before its residual
        out = h + layer.post_attention_layernorm(a)
        return out + layer.post_feedforward_layernorm(_states(layer.mlp(out)))
    out = h + a
    return out + _states(layer.mlp(layer.post_attention_layernorm(out)))


def _states(out):
    """A family's MLP output: gpt-oss's MoE block returns (states, router scores), the others the states."""
    return out[0] if isinstance(out, tuple) else out


def build_eagle3(target_model, aux_layers: Optional[Sequence[int]] = None, vocab_size: Optional[int] = None,
                 draft_vocab: Optional[torch.Tensor] = None, d2t: Optional[torch.Tensor] = None,
                 t2d: Optional[torch.Tensor] = None, layer: str = "llama", num_layers: int = 1,
                 **_unused) -> Eagle3Head:
    """Head for `target_model`. The vocabulary comes from a checkpoint's `d2t`/`t2d` (kept as saved), else
    from `draft_vocab` (target ids, e.g. heads.vocab.top_tokens), else it is the full target vocabulary. `layer`:
    llama or target (heads/layers.py LAYERS); heads.checkpoint.build_head passes what a record says (none: target)."""
    check_layer(layer)
    aux, d2t, t2d = aux_and_vocab(target_model, aux_layers, vocab_size, draft_vocab, d2t, t2d)
    return finish(Eagle3Head(target_model.config, aux, d2t, t2d, layer=layer, num_layers=num_layers), target_model)


def aux_and_vocab(target_model, aux_layers, vocab_size, draft_vocab, d2t, t2d) -> tuple[list[int], torch.Tensor,
                                                                                          torch.Tensor]:
    """The aux layer ids (default_aux_layers when None) and the d2t/t2d maps of an EAGLE-3-style head (build_eagle3)."""
    cfg = target_model.config.get_text_config()
    n_layers, n_vocab = cfg.num_hidden_layers, target_model.get_input_embeddings().weight.shape[0]
    aux = list(aux_layers) if aux_layers is not None else default_aux_layers(n_layers)
    if not aux or any(not 0 <= k < n_layers for k in aux):
        raise ValueError(f"aux_layers {aux}: each must be in [0, {n_layers - 1}] (HF hidden_states ids, pre-norm)")
    if d2t is not None:
        if t2d is None or t2d.numel() != n_vocab:
            raise ValueError("a checkpoint's d2t needs its t2d over the target vocabulary")
        d2t, t2d = d2t.to(torch.long), t2d.to(torch.bool)
    else:
        ids = draft_vocab if draft_vocab is not None else torch.arange(n_vocab)
        # draft ids follow ascending target ids, so `logits[..., t2d]` (what SpecForge-style code does) and
        # `logits[..., d2t-mapped ids]` agree
        d2t, t2d = vocab_maps(ids.to(torch.long).sort().values, n_vocab)
    if vocab_size is not None and d2t.numel() != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} but the draft vocabulary has {d2t.numel()} ids")
    return aux, d2t, t2d


def finish(head: Eagle3Head, target_model) -> Eagle3Head:
    """A new head's lm_head and norm from the target, on the target's device and dtype, bound to its embedding."""
    head.init_from_target(target_model)
    return head.to(device=target_model.device, dtype=target_model.dtype).bind(target_model)
