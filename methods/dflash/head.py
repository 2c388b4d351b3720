"""DFlash head (arXiv 2602.06036): draft a block of block_size - 1 tokens in one non-causal pass.

    states = cat(hidden_states[i + 1] for i in target_layer_ids)     # [B, T, n*H] target layer outputs
    ctx    = hidden_norm(fc(states))                                 # [B, T, H]   the fused target context
    x      = embed([anchor, MASK, ..., MASK])                        # [B, S, H]   S = block_size, target's embedding
    per layer (Qwen3 order):  a = input_layernorm(x)
        q = rope(q_norm(q_proj(a)))                  at the block's positions anchor .. anchor+S-1
        k = rope(k_norm(k_proj(cat(ctx, a))));  v = v_proj(cat(ctx, a))   ctx is NOT input-normed
        x = x + o_proj(attn(q, k, v));  x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))[:, 1:]                                 # the TARGET's lm_head (or its draft-vocab rows)

Block position k (0 = the anchor, the last committed token) sits at position anchor + k and predicts token
anchor + k; it attends to every context position u < anchor (context token u at position u) and to all S
positions of its own block, bidirectionally. These conventions are z-lab/dflash `dflash/model.py`'s
(`extract_context_feature`, `Qwen3DFlashAttention`, `DFlashDraftModel.forward`, `dflash_generate`).

Layer ids (z-lab's `dflash_config.target_layer_ids`): id i is decoder layer i (0-based) and its OUTPUT is used,
i.e. HF `output_hidden_states[i + 1]`, the un-normed residual stream after i + 1 layers. hidden_states[L] is
post-norm, so ids lie in [0, L-2]. Exports: z-lab/SpecForge `dflash_config.target_layer_ids` = ids as they are;
speculators `aux_hidden_state_layer_ids`, llama.cpp `dflash.target_layers` and vLLM = ids + 1 (the
hidden_states index). NOTE: EAGLE-3's `aux_layers` in this repo are hidden_states indices (no +1): not the same.

The layers are Qwen3-shaped whatever the target family (q_norm/k_norm, SiLU MLP, plain RMSNorm), built from
transformers' Qwen3 modules so state-dict keys map 1:1 onto speculators / llama.cpp names (`fc`, `hidden_norm`
(GGUF enc.output_norm), `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`); sizes and rope come from the target's text config.
The target's embedding and lm_head are held by reference (frozen, never saved). A reduced draft vocabulary is
`d2t`/`t2d` (heads.vocab, as EAGLE-3) and selects rows of the target's lm_head; never rebuilt when loaded.

dtype: master weights may be fp32 while the target is bf16. Each meeting point casts once: embedding output ->
head dtype, target states -> head dtype (in `context`), lm_head: hidden -> lm_head dtype, logits -> fp32.

Training (one call scores N blocks of each sequence; DDP sees it as forward):

    out = target(ids, output_hidden_states=True)
    ctx = head.context(head.target_states(out.hidden_states))    # [B, T, H]
    hidden = head(ctx, ids, anchors, valid)                       # [B, N, S, H]; anchors [B, N] long, valid [B, N] bool
    logits = head.logits(hidden[:, :, 1:])                        # [B, N, S-1, V_draft] fp32
    # block n, position k (1..S-1) predicts ids[:, anchors + k] (the target's token there)

Decoding (the draft's context cache holds K/V of committed positions only, so nothing is rolled back):

    cache = head.new_cache()
    # prefill: the target ran over x_0..x_{n-1} and committed x_n (the anchor).
    head.extend_cache(cache, head.context(head.target_states(out.hidden_states)))   # positions 0..n-1
    logits = head.draft_block(x_n, n, cache)                      # [B, S-1, V_draft] fp32 -> drafts d_1..d_{S-1}
    # The target verifies x_n, d_1..d_{S-1} at positions n..n+S-1, accepts a drafts and commits a bonus b.
    # Append the context of the ACCEPTED positions n..n+a only (their target states), then draft from b at n+a+1:
    head.extend_cache(cache, head.context(head.target_states(verify_out.hidden_states))[:, :a + 1])
    logits = head.draft_block(b, n + a + 1, cache)
`cache.crop(m)` keeps the first m positions (for callers that appended too much).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.core.errors import UserError
from selfspec.target.kernels import kind as kernel_kind, linear, packed_from
from selfspec.target.model import finish_logits
from selfspec.heads.vocab import draft_to_target, vocab_maps
from selfspec.registry import method

MAX_BLOCK_SIZE = method("dflash").most("block_size")  # registry.py: what a record may state


@dataclass
class DFlashConfig:
    """Schema of `draft=dflash` (Hydra group `draft/`)."""

    type: str = field(default="dflash", metadata={"help": "head type recorded in checkpoints (set by draft=dflash)"})
    block_size: int = field(default=8, metadata={"help": (
        "S: tokens per drafted block, the anchor (last committed token) plus S-1 mask positions, so one draft pass "
        "proposes S-1 tokens (vLLM num_speculative_tokens = S-1). In [2, 64]; released heads use 16.")})
    num_layers: int = field(default=3, metadata={"help": (
        "Non-causal Qwen3-style decoder layers. Released heads use 5; 3 keeps the draft pass cheap on a 2-core "
        "CPU, where every layer is paid on each drafted block (vLLM #49730: below tau ~4 a block pass does not pay).")})
    target_layer_ids: Optional[list[int]] = field(default=None, metadata={"help": (
        "Target decoder layers whose OUTPUTS are fused, z-lab's convention: id i = HF output_hidden_states[i + 1], "
        "each in [0, L-2], distinct. Exports write them as-is for z-lab/SpecForge and as i + 1 for speculators "
        "aux_hidden_state_layer_ids, llama.cpp dflash.target_layers and vLLM. null = z-lab's default: num_layers "
        "ids spread evenly from 1 to L-3 (SmolLM2-135M, 3 layers: [1, 14, 27]), clamped and deduplicated for "
        "shallow targets.")})
    mask_token_id: Optional[int] = field(default=None, metadata={"help": (
        "Token id embedded at the S-1 mask positions; must be an existing embedding row (engines embed it with the "
        "target's table). null = automatic (heads.dflash.default_mask_token_id): the first padded row past the "
        "tokenizer if the embedding has spare rows, else the highest-id special token that is not bos/eos/pad/unk "
        "and not in the chat template (SmolLM2: 16 '<empty_output>', a code-data marker chat never produces); "
        "built without a tokenizer, the last embedding row. The chosen id is recorded in the checkpoint.")})
    vocab_size: Optional[int] = field(default=None, metadata={"help": (
        "Reduced draft vocabulary: logits only over the N most frequent assistant tokens (rows of the target's "
        "lm_head, saved as d2t/t2d, never rebuilt). null = the target's full vocabulary.")})


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's build_target_layer_ids (num_draft_layers ids evenly from 1 to L-3; one layer: L//2), clamped into
    [0, L-2] and deduplicated, so a 2- or 4-layer test target still gets valid distinct ids."""
    if num_target_layers < 2:
        raise UserError(f"a DFlash head fuses un-normed outputs of layers 0..L-2: this target has "
                        f"{num_target_layers} layer(s)")
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    ids = [min(max(i, 0), num_target_layers - 2) for i in ids]
    return list(dict.fromkeys(ids))


def default_mask_token_id(tokenizer, num_rows: int) -> int:
    """An existing embedding row that chat data never produces: the first padded row past the tokenizer when the
    embedding has spare rows (Qwen, the tiny test targets), else the highest-id added special token that is not
    bos/eos/pad/unk and whose text is absent from the chat template (SmolLM2-135M: 16 '<empty_output>')."""
    if num_rows > len(tokenizer):
        return len(tokenizer)
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    free = [i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", True) and i not in taken and i < num_rows and str(t) not in template]
    if not free:
        raise UserError("no spare embedding row and no unused special token for DFlash's mask: set "
                        "draft.mask_token_id to a token id chat data never produces")
    return max(free)


class DFlashCache:
    """Per-layer K/V of the committed context (after k_norm and RoPE): keys/values[l] [B, kv_heads, P, head_dim]
    for positions 0..P-1. Only accepted positions are appended, so decoding never rolls it back."""

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        if self.keys[0] is not None:
            self.keys = [k[:, :, :length] for k in self.keys]
            self.values = [v[:, :, :length] for v in self.values]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], cos/sin [B, T, D] -> x rotated (transformers' rotate_half convention)."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention with its parameter names, queries from the block, keys/values from context + block."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] (context or normed block) -> K, V [B, kv_heads, T, head_dim], K after k_norm and RoPE."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, *rope), v

    def forward(self, x: torch.Tensor, rope: tuple, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """x [B, Q, H] normed block states; ctx_k/ctx_v [B, kv_heads, P, D]; mask [B, 1, Q, P+Q] bool (True =
        attend) or None (every query sees everything) -> [B, Q, H]."""
        b, q_len, _ = x.shape
        q = _rope(self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2), *rope)
        k, v = self.kv(x, rope)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        groups = self.heads // self.kv_heads  # GQA: repeat K/V per query group, as transformers' repeat_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer (input_layernorm, self_attn, post_attention_layernorm, mlp)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, rope, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def draft_config(target_config, num_layers: int):
    """The head's Qwen3Config: sizes and rope of the target's text config, Qwen3 layers (SiLU, q/k norm)."""
    from transformers import Qwen3Config

    tc = target_config.get_text_config()
    rope = dict(getattr(tc, "rope_parameters", None)
                or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)})
    if "full_attention" in rope:  # Gemma 3: rope per layer type; the head attends globally
        rope = dict(rope["full_attention"])
    return Qwen3Config(
        vocab_size=1, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads, hidden_act="silu",
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps, rope_parameters=rope,
        attention_bias=False, tie_word_embeddings=False, initializer_range=getattr(tc, "initializer_range", 0.02))


class DFlashHead(nn.Module):
    head_type = "dflash"
    # methods besides forward that training calls on the head's own weights (context: fc, hidden_norm; logits:
    # norm); under FSDP they gather the weights as forward does (train/loop.start_run)
    forward_methods = ("context", "logits")

    def __init__(self, target_config, block_size: int, num_layers: int, target_layer_ids: Sequence[int],
                 mask_token_id: int, d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        cfg = draft_config(target_config, num_layers)
        self.config = cfg
        self.block_size, self.mask_token_id = int(block_size), int(mask_token_id)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        hidden = cfg.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(num_layers)])
        self.norm = Qwen3RMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)  # inv_freq is a non-persistent buffer: not saved
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)
        if d2t is not None:  # reduced draft vocabulary (heads.vocab): saved with the head, never rebuilt
            self.register_buffer("d2t", d2t.to(torch.long).clone(), persistent=True)  # [V_draft]
            self.register_buffer("t2d", t2d.to(torch.bool).clone(), persistent=True)  # [V_target]
        else:
            self.d2t = self.t2d = None
        self._shared: tuple = ()  # (embed_tokens, lm_head, config) of the target, by reference
        self._lm_rows: Optional[torch.Tensor] = None  # lm_head rows of the draft vocabulary (derived, not saved)

    # ------------------------------------------------------------------ binding the target's shared parts
    def bind(self, target_model) -> "DFlashHead":
        """Share the target's embedding and lm_head by reference (never parameters of the head)."""
        self._shared = (target_model.get_input_embeddings(), target_model.get_output_embeddings(), target_model.config)
        self._lm_rows = None
        return self

    def _target(self, i: int):
        if not self._shared:
            raise RuntimeError("DFlashHead.bind(target_model) must be called before use")
        return self._shared[i]

    @property
    def embed_tokens(self) -> nn.Module:
        return self._target(0)

    # ------------------------------------------------------------------ the fused target context
    def target_states(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's `output_hidden_states` tuple -> [B, T, n*H]: outputs of layers target_layer_ids."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def context(self, states: torch.Tensor) -> torch.Tensor:
        """[B, T, n*H] target states (any dtype) -> the fused context hidden_norm(fc(states)) [B, T, H]."""
        return self.hidden_norm(self.fc(states.to(self.fc.weight.dtype)))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # the target's table is frozen
            return self.embed_tokens(ids).to(self.fc.weight.dtype)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        return self.rotary_emb(x, position_ids)  # (cos, sin) [B, T, head_dim] in x's dtype

    def _block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor ids [...] -> [..., S] token ids: the anchor then S-1 mask tokens."""
        block = anchor_ids.new_full((*anchor_ids.shape, self.block_size), self.mask_token_id)
        block[..., 0] = anchor_ids
        return block

    # ------------------------------------------------------------------ training: many blocks per sequence
    def forward(self, ctx: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Score N blocks per sequence in one pass -> pre-norm hidden [B, N, S, H].

        ctx [B, T, H] (head.context(...)); input_ids [B, T]; anchors [B, N] long, each in [0, T); valid [B, N]
        bool (None = all). Block n = [input_ids[anchor_n], MASK x (S-1)] at positions anchor_n .. anchor_n+S-1;
        it attends to context positions u < anchor_n and to its own S positions (so right padding of the context
        is never seen by a valid block). Invalid blocks see only themselves (finite, meaningless): mask them out
        of the loss. Labels: block n position k (1..S-1) predicts the token at anchor_n + k.
        """
        b, t, _ = ctx.shape
        n, s = anchors.shape[1], self.block_size
        valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else valid.to(torch.bool)
        anchors = torch.where(valid, anchors.to(torch.long), 0)  # padding anchors may hold anything
        x = self._embed(self._block_inputs(input_ids.gather(1, anchors)).view(b, n * s))  # [B, N*S, H]
        block_pos = (anchors[:, :, None] + torch.arange(s, device=ctx.device)).view(b, n * s)  # [B, N*S]
        ctx_pos = torch.arange(t, device=ctx.device)[None].expand(b, -1)  # [B, T]
        # mask [B, 1, N*S, T + N*S]: context u < anchor of the query's block; keys of the same block
        sees_ctx = (ctx_pos[:, None, :] < anchors[:, :, None]) & valid[:, :, None]  # [B, N, T]
        sees_ctx = sees_ctx[:, :, None, :].expand(b, n, s, t).reshape(b, n * s, t)
        blk = torch.arange(n, device=ctx.device).repeat_interleave(s)  # [N*S] block of each query/key
        same = (blk[:, None] == blk[None, :])[None].expand(b, -1, -1)
        mask = torch.cat([sees_ctx, same], dim=-1)[:, None]
        rope_blk, rope_ctx = self._rope(x, block_pos), self._rope(x, ctx_pos)
        for layer in self.layers:
            ck, cv = layer.self_attn.kv(ctx, rope_ctx)
            x = layer(x, rope_blk, ck, cv, mask)
        return x.view(b, n, s, -1)

    # ------------------------------------------------------------------ decoding
    def new_cache(self) -> DFlashCache:
        return DFlashCache(len(self.layers))

    def extend_cache(self, cache: DFlashCache, ctx: torch.Tensor) -> DFlashCache:
        """Append the context of the next committed positions: ctx [B, T_new, H] at positions len(cache) ..
        len(cache)+T_new-1 (rows of a batch share one committed length)."""
        start = len(cache)
        pos = torch.arange(start, start + ctx.shape[1], device=ctx.device)[None].expand(ctx.shape[0], -1)
        rope = self._rope(ctx, pos)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, rope)
            if cache.keys[i] is not None:
                k, v = torch.cat([cache.keys[i], k], dim=2), torch.cat([cache.values[i], v], dim=2)
            cache.keys[i], cache.values[i] = k, v
        return cache

    def draft_block(self, anchor_id, anchor_pos: int, cache: DFlashCache) -> torch.Tensor:
        """Logits of the S-1 mask positions [B, S-1, V_draft] (fp32). anchor_id [B] or [B, 1] (the last committed
        token), at position anchor_pos == len(cache): the cache holds exactly the positions before the anchor."""
        return self.logits(self.block_hidden(anchor_id, anchor_pos, cache)[:, 1:])

    def block_hidden(self, anchor_id, anchor_pos: int, cache: DFlashCache) -> torch.Tensor:
        """Pre-norm hidden states of the whole block [B, S, H], the anchor's included (draft_block's pass; a method
        built on this head that reads the anchor's row too, DSpark, calls it directly)."""
        anchor_pos = int(anchor_pos)
        if anchor_pos != len(cache):
            raise ValueError(f"anchor at position {anchor_pos} but the context cache holds {len(cache)} positions")
        anchor_id = torch.as_tensor(anchor_id).reshape(-1)
        x = self._embed(self._block_inputs(anchor_id))  # [B, S, H]
        pos = torch.arange(anchor_pos, anchor_pos + self.block_size, device=x.device)[None].expand(x.shape[0], -1)
        rope = self._rope(x, pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            empty = x.new_zeros(x.shape[0], attn.kv_heads, 0, attn.head_dim)  # anchor at 0: no context yet
            ck, cv = (cache.keys[i], cache.values[i]) if cache.keys[i] is not None else (empty, empty)
            x = layer(x, rope, ck, cv, None)  # no mask: the block sees the whole cache and itself
        return x

    # ------------------------------------------------------------------ vocabulary
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> fp32 logits [..., V_draft] through norm and the target's lm_head rows."""
        lm_head, target_config = self._target(1), self._target(2)
        w = lm_head.weight
        if self.d2t is not None:
            if self._lm_rows is None or self._lm_rows.device != w.device or self._lm_rows.dtype != w.dtype:
                self._lm_rows = w.detach()[self.draft_token_ids().to(w.device)]
            w = self._lm_rows
        x = self.norm(hidden).to(w.dtype)
        # the frozen target's rows, as its lm_head runs
        out = linear(x, w, packed_from=packed_from(lm_head), kind=kernel_kind(lm_head)).float()
        return finish_logits(target_config, out)  # what the target's *ForCausalLM does after lm_head (Gemma, Granite)

    def draft_token_ids(self) -> Optional[torch.Tensor]:
        """Target id of every draft id [V_draft]; None when the head drafts over the full vocabulary."""
        return None if self.d2t is None else draft_to_target(self.d2t)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def head_config(self) -> dict:
        return {"type": self.head_type, "block_size": self.block_size, "num_layers": len(self.layers),
                "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                "vocab_size": None if self.d2t is None else int(self.d2t.numel())}


def build_dflash(target_model, block_size: int = 8, num_layers: int = 3,
                 target_layer_ids: Optional[Sequence[int]] = None, mask_token_id: Optional[int] = None,
                 vocab_size: Optional[int] = None, tokenizer=None, draft_vocab: Optional[torch.Tensor] = None,
                 d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None, **_unused) -> DFlashHead:
    """Head for `target_model`; one-line UserError for a config it cannot build. The vocabulary comes from a
    checkpoint's `d2t`/`t2d` (kept as saved), else from `draft_vocab` (target ids, e.g. heads.vocab.top_tokens),
    else it is the full target vocabulary. `tokenizer` chooses mask_token_id when it is None (default_mask_token_id;
    recipes pass it); with neither, the mask is the last embedding row."""
    head = DFlashHead(**dflash_options(target_model, block_size, num_layers, target_layer_ids, mask_token_id,
                                       vocab_size, tokenizer, draft_vocab, d2t, t2d))
    return head.to(device=target_model.device, dtype=target_model.dtype).bind(target_model)


def dflash_options(target_model, block_size: int = 8, num_layers: int = 3,
                   target_layer_ids: Optional[Sequence[int]] = None, mask_token_id: Optional[int] = None,
                   vocab_size: Optional[int] = None, tokenizer=None, draft_vocab: Optional[torch.Tensor] = None,
                   d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None,
                   kind: str = "dflash") -> dict:
    """build_dflash's checks and defaults -> DFlashHead's constructor arguments (a head built on this one, DSpark,
    checks the same; `kind` names it in the messages)."""
    tc = target_model.config.get_text_config()
    n_target, n_rows = tc.num_hidden_layers, target_model.get_input_embeddings().weight.shape[0]
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not whole(block_size) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        what = "a string" if isinstance(block_size, str) else "no integer"
        kind_of = "" if whole(block_size) else f" ({what}: an integer is needed)"
        raise UserError(f"{kind} block_size={block_size!r}{kind_of}: must be in [2, {MAX_BLOCK_SIZE}] (the anchor + "
                        "at least one drafted token)")
    if not whole(num_layers) or num_layers < 1:
        raise UserError(f"{kind} num_layers={num_layers}: a head needs at least 1 layer")
    ids = (list(target_layer_ids) if target_layer_ids is not None
           else default_target_layer_ids(n_target, int(num_layers)))
    if not ids or any(not whole(i) or not 0 <= i <= n_target - 2 for i in ids):
        raise UserError(f"{kind} target_layer_ids {ids}: each must be in [0, {n_target - 2}] (decoder layer i, whose "
                        f"output is hidden_states[i + 1]; the target has {n_target} layers)")
    if len(set(ids)) != len(ids):
        raise UserError(f"{kind} target_layer_ids {ids} repeat a layer: each target layer is fused once")
    if mask_token_id is None:  # without a tokenizer (generic builders: fuzz, HEADS-wide tests) the last row
        mask_token_id = default_mask_token_id(tokenizer, n_rows) if tokenizer is not None else n_rows - 1
    if not whole(mask_token_id) or not 0 <= mask_token_id < n_rows:
        raise UserError(f"{kind} mask_token_id={mask_token_id} is outside the target's vocabulary [0, {n_rows})")
    if d2t is not None:
        if t2d is None or t2d.numel() != n_rows:
            raise UserError(f"a {kind} checkpoint's d2t needs its t2d over the target vocabulary; re-export the head")
        d2t, t2d = d2t.to(torch.long), t2d.to(torch.bool)
    elif draft_vocab is not None:
        # ascending target ids (heads/vocab.py vocab_maps): logits[..., t2d] and d2t-mapped ids agree
        d2t, t2d = vocab_maps(draft_vocab.to(torch.long).sort().values, n_rows)
    if vocab_size is not None and (d2t.numel() != vocab_size if d2t is not None else vocab_size < n_rows):
        raise UserError(f"{kind} vocab_size={vocab_size} needs a draft vocabulary of that size "
                        f"(got {None if d2t is None else d2t.numel()} ids; see heads.vocab.top_tokens)")
    return {"target_config": target_model.config, "block_size": block_size, "num_layers": num_layers,
            "target_layer_ids": ids, "mask_token_id": mask_token_id, "d2t": d2t, "t2d": t2d}
