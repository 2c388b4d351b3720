"""LayerSkip / Kangaroo-style early exit on a frozen target: draft with the target's own first E layers.

    h_E    = layers[0:E](embed(x))              # the target's residual stream after E layers (HF hidden_states[E])
    z      = adapter(h_E)                       # small and trained; `light` starts as the identity
    logits = lm_head(norm(z))                   # the target's OWN final norm and lm_head (frozen, by reference)

Adapters (`adapter=`):
- `light`: z = h + up(silu(down(rmsnorm(h)))), rank `rank`; `up` is zero-initialised, so an untrained exit is the
  target's norm + lm_head applied to layer E.
- `layer`: one decoder layer of the target's family (Kangaroo), causal over the sequence, so it keeps its own KV
  cache while drafting; initialised from target layer E (the layer that reads h_E in the target) when E < L.
- `lora`: no adapter after the exit; peft LoRA on the attention projections of layers 0..E-1, enabled only while
  drafting (peft's enable/disable of the target's tuner layers; disabled, a LoRA layer returns its base layer's
  output exactly, so verification stays lossless). The price: the draft pass's layer 0..E-1 keys/values then
  differ from the target's, so the target cannot reuse them and verification runs all L layers.

Layer E in [1, L] counts decoder layers (E = L with an untrained `light` adapter is the full model: an oracle).
The target's modules (embedding, layers, rotary embedding, final norm, lm_head) are held by reference: never
parameters of the head, never saved. heads/layers.py `run_layers` runs any slice of the target's decoder through its
own public modules; decode/kv.py uses it to verify from layer E on (the self-speculative cache reuse).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.layers import family_model_class
from selfspec.heads.layers import layer_types, run_layers
from selfspec.core.errors import UserError
from selfspec.target.kernels import kind as kernel_kind, linear, packed_from
from selfspec.target.model import embed, finish_logits

ADAPTERS = ("light", "layer", "lora")
LORA_NAME = "layerskip"  # the peft adapter name injected into the target


@dataclass
class LayerSkipConfig:
    """Schema of `draft=layerskip` (Hydra group `draft/`)."""

    type: str = field(default="layerskip", metadata={"help": (
        "head type recorded in checkpoints (set by draft=layerskip)")})
    exit_layer: int = field(default=8, metadata={"help": (
        "Exit after this many decoder layers (1..L; HF hidden_states[exit_layer]). SmolLM2-135M has L = 30.")})
    adapter: str = field(default="light", metadata={"help": (
        "light (norm + low-rank residual MLP) | layer (one decoder layer of the target family, Kangaroo) | lora "
        "(LoRA on layers < exit_layer, active only while drafting; verification cannot reuse their cache).")})
    rank: int = field(default=64, metadata={"help": "Inner width of the light adapter's residual MLP."})
    init_from_target: bool = field(default=True, metadata={"help": (
        "adapter=layer: start from target layer `exit_layer` (the layer that reads h_E in the target); false = "
        "random.")})
    lora_rank: int = field(default=8, metadata={"help": (
        "adapter=lora: LoRA rank, alpha (scale = alpha / rank) and which projections of layers < exit_layer get "
        "one.")})
    lora_alpha: float = field(default=16.0, metadata={"help": "adapter=lora: LoRA alpha (scale = alpha / rank)"})
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"], metadata={"help": (
        "adapter=lora: projections of the layers below exit_layer that get a LoRA")})
    vocab_size: Optional[int] = field(default=None, metadata={"help": (
        "Reduced draft vocabulary: logits over the N most frequent assistant tokens (null = the full vocabulary).")})


# ------------------------------------------------------------------------------------------- the target's layers


# ---------------------------------------------------------------------------------------------------- adapters


class LightAdapter(nn.Module):
    """z = h + up(silu(down(norm(h)))): a low-rank residual MLP; `up` starts at zero (z = h)."""

    def __init__(self, norm: nn.Module, hidden: int, rank: int):
        super().__init__()
        self.norm = norm  # a fresh copy of the family's RMSNorm (Gemma's keeps its 1 + w form)
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(F.silu(self.down(self.norm(h))))


def _one_layer_config(target_config, layer_type: str):
    cfg = copy.deepcopy(target_config.get_text_config())
    cfg.num_hidden_layers = 1
    cfg.vocab_size, cfg.pad_token_id = 1, None  # inputs_embeds only: a 1-row embedding
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [layer_type]
    cfg.tie_word_embeddings = False
    return cfg


# ------------------------------------------------------------------------------------------------------- head


class LayerSkipHead(nn.Module):
    head_type = "layerskip"
    # methods besides forward that training calls on the head's own weights: none (logits and normed read the
    # target's norm and lm_head); under FSDP such methods gather the weights as forward does (train/loop.start_run)
    forward_methods = ()

    def __init__(self, target_config, exit_layer: int, adapter: str = "light", rank: int = 64,
                 lora_rank: int = 8, lora_alpha: float = 16.0, lora_targets=("q_proj", "v_proj"),
                 draft_vocab: Optional[torch.Tensor] = None):
        super().__init__()
        tcfg = target_config.get_text_config()
        n_layers = tcfg.num_hidden_layers
        if adapter not in ADAPTERS:
            raise UserError(f"unknown layerskip adapter '{adapter}'; use one of {', '.join(ADAPTERS)}")
        if not 1 <= exit_layer <= n_layers:
            raise UserError(f"exit_layer={exit_layer} is outside the target's layers 1..{n_layers}")
        self.exit_layer, self.adapter_kind, self.num_layers = int(exit_layer), adapter, n_layers
        self.rank, self.lora_rank, self.lora_alpha = int(rank), int(lora_rank), float(lora_alpha)
        self.lora_targets = [str(t) for t in lora_targets]
        types = layer_types(tcfg)
        self.config = _one_layer_config(target_config, types[min(exit_layer, n_layers - 1)])
        if adapter == "light":
            base = family_model_class(self.config)(self.config)
            self.adapter = LightAdapter(base.norm, tcfg.hidden_size, rank)
        elif adapter == "layer":
            self.model = family_model_class(self.config)(self.config)  # one layer, HF masks/RoPE/KV caching
            self.model.norm = nn.Identity()  # the target's own final norm follows in logits()
            self.model.embed_tokens.requires_grad_(False)  # unused (inputs_embeds)
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone(), persistent=True)
        else:
            self.draft_vocab = None
        self._target: tuple = ()  # (target model,), by reference: never a submodule
        self._lora_layers: list = []  # the peft tuner layers injected into the target (adapter=lora)
        self._lora_depth = 0
        self._lm_rows: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ binding the target
    def bind(self, target_model) -> "LayerSkipHead":
        """Hold the target's modules by reference; adapter=lora injects its (disabled) LoRA layers into it."""
        n = target_model.config.get_text_config().num_hidden_layers
        if n != self.num_layers:
            raise UserError(f"this layerskip head is for a {self.num_layers}-layer target; this target has {n} layers")
        self._target = (target_model,)
        self._lm_rows = None
        if self.adapter_kind == "lora" and not self._lora_layers:
            self._inject_lora(target_model)
        return self

    @property
    def target_model(self):
        if not self._target:
            raise RuntimeError("LayerSkipHead.bind(target_model) must be called before use")
        return self._target[0]

    def _inject_lora(self, target_model) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(m, BaseTunerLayer) and LORA_NAME in getattr(m, "lora_A", {})
               for m in target_model.modules()):
            raise UserError("this target already carries a layerskip LoRA exit; load one LoRA exit per target")
        lcfg = LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, target_modules=self.lora_targets,
                          layers_to_transform=list(range(self.exit_layer)), layers_pattern="layers",
                          lora_dropout=0.0, bias="none")
        inject_adapter_in_model(lcfg, target_model, adapter_name=LORA_NAME)
        a, b = nn.ModuleDict(), nn.ModuleDict()
        for name, m in target_model.named_modules():
            if isinstance(m, BaseTunerLayer) and LORA_NAME in getattr(m, "lora_A", {}):
                key = name.replace(".", "_")
                a[key], b[key] = m.lora_A[LORA_NAME], m.lora_B[LORA_NAME]  # shared modules: saved with the head
                self._lora_layers.append(m)
        if not self._lora_layers:
            raise UserError(f"lora_targets {self.lora_targets} match no module of the target's layers < "
                            f"{self.exit_layer}")
        self.lora_A, self.lora_B = a, b
        self._set_lora(False)  # the target stays the target except while drafting

    def _set_lora(self, on: bool) -> None:
        for m in self._lora_layers:
            m.enable_adapters(on)

    @contextlib.contextmanager
    def drafting(self):
        """LoRA on for the draft pass (and its backward when training); nested uses are fine. No-op otherwise."""
        if not self._lora_layers:
            yield
            return
        self._lora_depth += 1
        if self._lora_depth == 1:
            self._set_lora(True)
        try:
            yield
        finally:
            self._lora_depth -= 1
            if self._lora_depth == 0:
                self._set_lora(False)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates (LoRA weights live in the target's modules and are toggled by peft)."""
        return [p for n, p in self.named_parameters() if n.startswith(("adapter.", "model.layers", "lora_"))]

    @property
    def shares_target_cache(self) -> bool:
        """Whether the draft pass's layer 0..E-1 keys/values are the target's own (not with LoRA on them)."""
        return self.adapter_kind != "lora"

    # ------------------------------------------------------------------ forward
    def prefix(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache=None,
               attention_mask=None) -> torch.Tensor:
        """Token ids [B, T] -> h_E [B, T, H]: the target's embedding and layers 0..E-1 (with LoRA for adapter=lora).
        Extends `cache` (the target's own for light/layer, a separate one for lora) for those layers."""
        model = self.target_model
        with self.drafting():
            h = embed(model, input_ids)  # [B, T, H]; Granite scales it (target/model.py)
            return run_layers(model, h, 0, self.exit_layer, position_ids, cache, attention_mask)

    def forward(self, h: torch.Tensor, position_ids: Optional[torch.Tensor] = None, past_key_values=None,
                attention_mask=None) -> torch.Tensor:
        """h_E [B, T, H] -> the exit's pre-norm state [B, T, H]. Only adapter=layer reads positions/cache/mask
        (None = causal over its cache + these tokens, a 2-D padding mask, or a prepared 4-D / per-type mask)."""
        if self.adapter_kind == "light":  # h_E comes in the target's dtype; the exit's weights may be fp32
            return self.adapter(h.to(self.adapter.down.weight.dtype))
        if self.adapter_kind == "layer":
            h = h.to(self.model.dtype)
            if position_ids is None:
                position_ids = torch.arange(h.shape[1], device=h.device)[None]
            out = self.model(inputs_embeds=h, position_ids=position_ids, past_key_values=past_key_values,
                             attention_mask=attention_mask, use_cache=past_key_values is not None)
            return out.last_hidden_state
        return h

    def normed(self, z: torch.Tensor) -> torch.Tensor:
        """The target's final norm (what HF hidden_states[-1] holds for the full model)."""
        return self.target_model.get_decoder().norm(z)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Pre-norm exit state [B, T, H] -> [B, T, V_draft] through the target's final norm and lm_head."""
        model = self.target_model
        lm_head = model.get_output_embeddings()
        x = self.normed(z).to(lm_head.weight.dtype)  # in the lm_head's dtype, as EAGLE-1's head's logits
        if self.draft_vocab is None:
            out = lm_head(x)
        else:
            if self._lm_rows is None or self._lm_rows.device != x.device:
                self._lm_rows = lm_head.weight.detach()[self.draft_vocab.to(lm_head.weight.device)]
            out = linear(x, self._lm_rows, packed_from=packed_from(lm_head),
                         kind=kernel_kind(lm_head))  # as the lm_head runs
        return finish_logits(model.config, out)  # Granite's logits_scaling, Gemma's soft-cap

    def draft_token_ids(self) -> Optional[torch.Tensor]:
        """Target id of every draft id [V_draft]; None when the exit drafts over the full vocabulary."""
        return self.draft_vocab

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab.to(draft_ids.device)[draft_ids]

    def head_config(self) -> dict:
        cfg = {"type": self.head_type, "exit_layer": self.exit_layer, "adapter": self.adapter_kind,
               "num_target_layers": self.num_layers,
               "vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel())}
        if self.adapter_kind == "light":
            cfg["rank"] = self.rank
        if self.adapter_kind == "lora":
            cfg.update(lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, lora_targets=list(self.lora_targets))
        return cfg


def check_exit(record_head: dict, exit_layer: Optional[int] = None, adapter: Optional[str] = None) -> None:
    """Refuse a layerskip checkpoint whose exit layer / adapter is not the one asked for (one line)."""
    if exit_layer is not None and int(record_head.get("exit_layer", -1)) != int(exit_layer):
        raise UserError(f"this layerskip head exits at layer {record_head.get('exit_layer')}, not at the requested "
                        f"exit_layer={exit_layer}; train one for that layer or drop exit_layer=")
    if adapter is not None and record_head.get("adapter") != adapter:
        raise UserError(f"this layerskip head has a '{record_head.get('adapter')}' adapter, not the requested "
                        f"'{adapter}'")


def check_sizes(target_model, adapter: str, rank: int, lora_rank: int) -> None:
    """Adapter sizes a target can use, refused before a tensor is allocated (a rank mistyped by a few digits would
    otherwise take the memory first): a light adapter (2 * rank * H weights) no larger than the target itself; a
    LoRA rank no larger than the hidden size (B @ A on an H-wide projection has rank <= H: more is only memory)."""
    hidden = target_model.config.get_text_config().hidden_size
    if adapter == "light":
        weights, target_weights = 2 * rank * hidden, sum(p.numel() for p in target_model.parameters())
        if weights > target_weights:
            raise UserError(f"rank={rank} makes a light adapter of {weights:,} weights, larger than the target "
                            f"itself ({target_weights:,}); pass a smaller rank (64 is the default)")
    if adapter == "lora" and lora_rank > hidden:
        raise UserError(f"lora_rank={lora_rank} exceeds the target's hidden size {hidden} (a LoRA update of a "
                        f"projection {hidden} wide has rank <= {hidden}); pass a smaller lora_rank (8 is the default)")


def build_layerskip(target_model, exit_layer: int = 8, adapter: str = "light", rank: int = 64,
                    init_from_target: bool = True, lora_rank: int = 8, lora_alpha: float = 16.0,
                    lora_targets=("q_proj", "v_proj"), vocab_size: Optional[int] = None,
                    draft_vocab: Optional[torch.Tensor] = None, num_target_layers: Optional[int] = None,
                    **_unused) -> LayerSkipHead:
    """A fresh exit for `target_model`. `draft_vocab` (ids) is required iff vocab_size. `num_target_layers` (from a
    checkpoint) must match the target."""
    n = target_model.config.get_text_config().num_hidden_layers
    if num_target_layers is not None and int(num_target_layers) != n:
        raise UserError(f"this layerskip head is for a {num_target_layers}-layer target; this target has {n} layers")
    if vocab_size is not None and (draft_vocab is None or draft_vocab.numel() != vocab_size):
        raise ValueError("a reduced draft vocabulary needs its token ids (see heads.vocab.top_tokens)")
    check_sizes(target_model, adapter, rank, lora_rank)
    head = LayerSkipHead(target_model.config, exit_layer, adapter=adapter, rank=rank, lora_rank=lora_rank,
                         lora_alpha=lora_alpha, lora_targets=lora_targets, draft_vocab=draft_vocab)
    if adapter == "light":
        with torch.no_grad():  # start the adapter's input norm as the target's final norm (any norm works: up = 0)
            head.adapter.norm.load_state_dict(target_model.get_decoder().norm.state_dict())
    if adapter == "layer" and init_from_target and exit_layer < n:
        src = target_model.get_decoder().layers[exit_layer].state_dict()
        head.model.layers[0].load_state_dict(src)
    head = head.to(device=target_model.device, dtype=target_model.dtype)
    return head.bind(target_model)
