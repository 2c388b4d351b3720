"""The model card (README.md) of a published head: Hub metadata built and checked with huggingface_hub's own
ModelCardData, and a body that describes THIS head, whatever its type.

Every fact comes from the head itself: its record (config.json: heads/checkpoint.py `head_record`, the head's
`head_config()`, the training record and held-out metrics) and its state dict (the tensor table lists what the
weights file really holds). `ModelCard.validate()` posts the card to the Hub, so the metadata is checked offline
instead: the rendered card is parsed back with `ModelCard` and must give the metadata it was built from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch
from huggingface_hub import ModelCard, ModelCardData

from selfspec.core.target import EMBEDDED
from selfspec.heads.checkpoint import trained_seconds
from selfspec.heads.eagle import recorded_layer
from selfspec.registry import method, names

# Licenses of the targets we know, inherited by their heads (a head is trained on the target's outputs and
# is useless without it). Unknown targets get no license line: the card tells the reader to check the base's.
TARGET_LICENSES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0",
    "HuggingFaceTB/SmolLM2-360M-Instruct": "apache-2.0",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": "apache-2.0",
    "Qwen/Qwen2.5-0.5B-Instruct": "apache-2.0",
    "Qwen/Qwen2.5-1.5B-Instruct": "apache-2.0",
    "Qwen/Qwen3-1.7B": "apache-2.0",
    "google/gemma-3-270m-it": "gemma",
    "meta-llama/Llama-3.2-1B-Instruct": "llama3.2",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3.1",
}
# Training-data names (data.path) with a Hub dataset id, for the card's `datasets:` metadata.
DATASETS = {None: "anon8231489123/ShareGPT_Vicuna_unfiltered", "sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
SHARED_TAGS = ["speculative-decoding", "draft-model", "selfspec"]
EMBED_STUB = "model.embed_tokens.weight"  # the family model's unused 1-row embedding (the target's is used)
TENSOR_NOTES = {EMBED_STUB: "unused 1-row stub (the target's embedding is used)",
                "draft_vocab": "target ids of the draft vocabulary, most frequent first",
                "d2t": "draft id -> target id offset (target id = draft id + d2t[draft id])",
                "t2d": "true for the target ids the draft can emit"}
Rows = list[tuple[str, Any]]  # (name, value) of the card's head table; rows without a value are left out


def target_hub_id(identity: dict[str, Any]) -> Optional[str]:
    """The Hub id of the head's target: embedded targets map to their origin; tiny/local targets have none."""
    name = str(identity.get("name_or_path") or "")
    if name.startswith("embedded:"):
        entry = EMBEDDED.get(name.split(":", 1)[1])
        return entry[0] if entry else None
    if name.startswith(("tiny:", ".", "/", "~")) or name.count("/") != 1 or Path(name).exists():
        return None
    return name


def _tags(head_type: str) -> list[str]:
    """A head type's Hub tags (Method.tags; an unknown type is its own tag)."""
    return list(method(head_type).tags) if head_type in names() else [head_type]


def card_metadata(record: dict[str, Any]) -> ModelCardData:
    """The card's YAML: license and base_model when the target is known, library, tags, pipeline, datasets.
    No model-index: results are in the body, measured by selfspec, not Hub-evaluated."""
    base = target_hub_id(record["target"])
    data = (record.get("training") or {}).get("data")
    dataset = DATASETS.get(data.get("path")) if isinstance(data, dict) else None
    head_type = record["head"].get("type", "eagle")
    return ModelCardData(base_model=base, license=TARGET_LICENSES.get(base or ""), library_name="selfspec",
                         pipeline_tag="text-generation", tags=SHARED_TAGS + _tags(head_type),
                         datasets=[dataset] if dataset else None)


def model_card(record: dict[str, Any], repo_id: str, state: dict[str, torch.Tensor],
               bench: Optional[dict[str, Any]] = None, serving: Optional[dict[str, Any]] = None) -> str:
    """README.md for `repo_id`: metadata, what the head is, its tensors, training, results (selfspec's `bench.json`,
    and `serving`: scripts/serve_bench.py's JSON, the head inside serving engines), usage, files."""
    meta = card_metadata(record)
    head, target = record["head"], record["target"]
    head_type = head.get("type", "eagle")
    base = target_hub_id(target)
    base_link = f"[{base}](https://huggingface.co/{base})" if base else f"`{target.get('name_or_path')}`"
    kind = method(head_type).title if head_type in names() else f"`{head_type}`"
    body = [f"# {repo_id.split('/', 1)[1]}", "",
            f"{'An' if kind[0] in 'AEIOU' else 'A'} {kind} draft head for {base_link}, trained with selfspec on the "
            "frozen target. It proposes tokens that the target verifies, so output is exactly the target's own "
            "(greedy, and sampling with the exact acceptance rule); only the speed changes.", ""]
    section = method(head_type).load("card") if head_type in names() else _unknown  # Method.card: its section
    diagram, rows = section(head, target, state)
    body += ["## Head", "", "```", *diagram, "```", ""] + _table(rows + _target_rows(record, base)) + [""]
    n = _params(state)
    body += ["## Tensors", "", f"`model.safetensors` holds {n:,} trained parameters ({n / 1e6:.2f}M):", ""]
    body += _tensor_table(state) + [""]
    body += ["## Training", ""] + _training_lines(record.get("training") or {}) + [""]
    body += ["## Results", ""] + _results_lines(record.get("metrics") or {}, bench, serving is not None) + [""]
    if serving:
        body += ["## In serving engines", ""] + _serving_lines(serving) + [""]
    body += ["## Usage", ""] + _usage_lines(repo_id, head, target, base)
    body += ["## Files", "",
             "- `config.json`: the selfspec head record (head type and config, target identity, training, metrics)",
             "- `model.safetensors`: the head's weights (the tensors above)", ""]
    if not meta.license:
        body += ["License: the base model's license applies to this head; check it before use.", ""]
    card = ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(body))
    if card.data.to_dict() != meta.to_dict():  # the YAML the Hub will read is the metadata we meant
        raise ValueError(f"model card metadata does not round-trip: {card.data.to_dict()} != {meta.to_dict()}")
    return str(card)


# ---------------------------------------------------------------------------------------------- per head type


def _eagle(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """EAGLE-1/2: fc over (embedding, feature) pairs, then the family's own decoder layer(s)."""
    hidden, fc_in = _shape(state, "fc.weight", (target.get("hidden_size"), None))
    vocab = head.get("vocab_size")
    lines = [f"x      = fc(cat(embed(token_t+1), f_t))   # [B, T, {fc_in}] -> [B, T, {hidden}]  (2H -> H)",
             f"f_t+1' = {head.get('num_layers', 1)} {target.get('model_type')} decoder layer(s)(x)  "
             "# no input norm on layer 0, no final norm",
             "logits = the target's lm_head(f_t+1')" + (f"  # rows of the {vocab} draft tokens" if vocab else "")]
    rows = [("type", "`eagle` (EAGLE-1/2): extrapolates the target's next post-norm hidden state"),
            ("fc", f"{fc_in} -> {hidden} (2H -> H), "
             + ("with bias (not servable by vLLM: use selfspec or SGLang)" if head.get("fc_bias") else "no bias")),
            ("decoder layers", f"{head.get('num_layers', 1)} ({target.get('model_type')} family)"),
            ("draft vocabulary", f"{vocab} most frequent target tokens (`draft_vocab`)" if vocab
             else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("embedding, lm_head", "the target's (held by reference, not stored)")]
    return lines, rows


def _eagle3(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """EAGLE-3: fc over three target layers, a midlayer over (embedding, hidden), its own lm_head."""
    aux = [int(k) for k in head.get("aux_layers") or []]
    hidden, fc_in = _shape(state, "fc.weight", (target.get("hidden_size"), None))
    _, mid_in = _shape(state, "layers.0.self_attn.q_proj.weight", (None, None))
    v_draft = int(state["d2t"].numel()) if "d2t" in state else head.get("vocab_size")
    fused = ", ".join(f"A_{k}" for k in aux)
    lines = [f"step 0: h = fc(cat({fused}))   # [B, T, {fc_in}] -> [B, T, {hidden}]: target hidden_states {aux}",
             "step j: h = the head's own pre-norm output of step j-1",
             f"x      = cat(input_layernorm(embed(token)), hidden_norm(h))   # [B, T, {mid_in}]: q/k/v take 2H",
             "out    = h + attn(x);  out = out + mlp(post_attention_layernorm(out))",
             f"logits = lm_head(norm(out))   # the head's own lm_head over {v_draft} draft tokens; d2t -> target ids"]
    rows = [("type", "`eagle3` (EAGLE-3): drafts from fused target layers, then from its own output"),
            ("aux layers", f"{aux} (HF `hidden_states` ids: the un-normed residual stream after k layers)"),
            ("fc", f"{fc_in} -> {hidden} ({len(aux)} aux layers x H, no bias)"),
            ("midlayer", f"one {target.get('model_type')} decoder layer, q/k/v over {mid_in} (2H) inputs, "
                         "plus `hidden_norm`"),
            ("norm before residual", "yes" if head.get("norm_before_residual") else None),
            ("draft vocabulary", f"{v_draft} of the target's {target.get('vocab_size')} tokens "
                                 "(`d2t` draft -> target, `t2d` target -> drafted)"),
            ("embedding", "the target's (held by reference, not stored); lm_head and final norm are the head's own")]
    return lines, rows


def _peagle(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """P-EAGLE: EAGLE-3's fc and layers, every depth from one pass over [anchor, mask slots]."""
    aux = [int(k) for k in head.get("aux_layers") or []]
    hidden, fc_in = _shape(state, "fc.weight", (target.get("hidden_size"), None))
    k, n = head.get("depth"), head.get("num_layers", 1)
    v_draft = int(state["d2t"].numel()) if "d2t" in state else head.get("vocab_size")
    lines = [f"anchor: (fc(cat(A_{', A_'.join(map(str, aux))})), next token)   # [B, T, {fc_in}] -> {hidden}",
             f"slots:  (fc(mask_hidden), id {head.get('mask_token_id')}) x {k - 1 if k else 'K-1'}   "
             "# positions after the anchor",
             f"out    = {n} Llama layer(s) over [anchor, slots], causal; the first over cat(norm(embed), "
             "hidden_norm(h))",
             f"logits = lm_head(norm(out))   # depth d from row d, all in ONE pass; {v_draft} draft tokens"]
    rows = [("type", "`peagle` (P-EAGLE): EAGLE-3 drafting every depth in one forward pass (vLLM parallel_drafting)"),
            ("depth", f"{k} tokens per draft pass"),
            ("aux layers", f"{aux} (HF `hidden_states` ids)"),
            ("layers", f"{n} Llama decoder layer(s); `mask_hidden` [{fc_in}] and mask token "
                       f"{head.get('mask_token_id')}"),
            ("draft vocabulary", f"{v_draft} of the target's {target.get('vocab_size')} tokens (`d2t`/`t2d`)"),
            ("embedding", "the target's (held by reference, not stored); lm_head and final norm are the head's own")]
    return lines, rows


ADAPTER_TEXT = {"light": "z = h_E + up(silu(down(rmsnorm(h_E)))), a low-rank residual MLP (`up` starts at zero)",
            "layer": "z = one decoder layer of the target's family over h_E (Kangaroo), causal with its own KV cache",
            "lora": "z = h_E: the exit has no adapter; LoRA on layers 0..E-1, enabled only while drafting"}


def _layerskip(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """LayerSkip / Kangaroo: the target's own first E layers, an adapter, the target's own norm and lm_head."""
    exit_layer, n_layers = head.get("exit_layer"), head.get("num_target_layers") or target.get("num_hidden_layers")
    kind, vocab = head.get("adapter"), head.get("vocab_size")
    lines = [f"h_E    = the target's layers[0:{exit_layer}](embed(x))   # [B, T, {target.get('hidden_size')}]",
             f"z      = adapter(h_E)   # {kind}",
             "logits = the target's own lm_head(norm(z))" + (f"  # rows of the {vocab} draft tokens" if vocab else "")]
    adapter = ADAPTER_TEXT.get(kind, f"`{kind}`")
    if kind == "light":
        adapter += f", rank {head.get('rank')}"
    if kind == "lora":
        adapter += (f" (rank {head.get('lora_rank')}, alpha {head.get('lora_alpha')}, on "
                    f"{', '.join(head.get('lora_targets') or [])})")
    reuse = ("all the target's layers: the draft pass ran layers 0..E-1 with LoRA on, so their keys/values are not "
             "the target's" if kind == "lora" else
             f"the target reuses the draft pass's keys/values of layers 0..{exit_layer - 1} and runs only layers "
             f"{exit_layer}..{n_layers - 1} (self-speculative)")
    rows = [("type", "`layerskip`: self-speculative early exit, the target drafts with its own first layers"),
            ("exit layer", f"{exit_layer} of {n_layers} decoder layers (HF `hidden_states[{exit_layer}]`)"),
            ("adapter", f"`{kind}`: {adapter}"),
            ("verification", reuse),
            ("draft vocabulary", f"{vocab} most frequent target tokens (`draft_vocab`)" if vocab
             else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("target parts used", "embedding, layers 0..E-1, final norm and lm_head: by reference, not stored")]
    return lines, rows


def _dflash(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """DFlash: fc over several target layers, a few non-causal layers over [anchor, MASK x (S-1)], the target's
    embedding and lm_head."""
    ids = [int(i) for i in head.get("target_layer_ids") or []]
    hidden, fc_in = _shape(state, "fc.weight", (target.get("hidden_size"), None))
    s, n = head.get("block_size"), sum(1 for k in state if k.endswith("input_layernorm.weight"))
    v_draft = int(state["d2t"].numel()) if "d2t" in state else None
    lines = [f"ctx    = hidden_norm(fc(cat(layer outputs {ids})))   # [B, T, {fc_in}] -> [B, T, {hidden}]",
             f"x      = embed([anchor, MASK x {s - 1 if s else 'S-1'}])   # the target's embedding, MASK = id "
             f"{head.get('mask_token_id')}",
             f"x      = {n} non-causal Qwen3-style layers(x; keys/values over cat(ctx, x))",
             "logits = the target's lm_head(norm(x))[1:]   # one draft per block position, all in ONE pass"
             + (f"; rows of the {v_draft} draft tokens" if v_draft else "")]
    rows = [("type", "`dflash` (DFlash): drafts a whole block in one non-causal pass"),
            ("block size", f"{s}: the anchor (last committed token) and {s - 1 if s else 'S-1'} drafted tokens"),
            ("target layer ids", f"{ids} (decoder layer i's OUTPUT = HF `hidden_states[i + 1]`; speculators, vLLM and "
                                 "llama.cpp store ids + 1)"),
            ("fc", f"{fc_in} -> {hidden} ({len(ids)} layers x H, no bias), then `hidden_norm`"),
            ("draft layers", f"{n}, bidirectional within the block, attending to the fused context of earlier "
                             "positions"),
            ("draft vocabulary", f"{v_draft} of the target's {target.get('vocab_size')} tokens (`d2t`/`t2d`)"
             if v_draft else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("embedding, lm_head", "the target's (held by reference, not stored)")]
    return lines, rows


def _unknown(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    return [f"a `{head.get('type')}` head: {head}"], [("type", f"`{head.get('type')}`")]


# ---------------------------------------------------------------------------------------------- shared sections


def _target_rows(record: dict[str, Any], base: Optional[str]) -> Rows:
    target = record["target"]
    name = target.get("name_or_path")
    return [
        ("target", f"`{name}`" + (f" = {base}" if base and base != name else "")
         + (f" @ {target['revision']}" if target.get("revision") else "")),
        ("target shape", f"{target.get('model_type')}, hidden {target.get('hidden_size')}, "
                         f"{target.get('num_hidden_layers')} layers, vocab {target.get('vocab_size')}"),
        ("target fingerprint", f"`{target.get('fingerprint')}` (heads are refused by any other target)"),
        ("format", f"selfspec head format {record.get('format_version')}")]


def _table(rows: Rows) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v]


def _shape(state: dict[str, torch.Tensor], name: str, default: tuple) -> tuple:
    return tuple(state[name].shape) if name in state else default


def _params(state: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() for k, v in state.items() if v.is_floating_point() and k != EMBED_STUB)


def _tensor_table(state: dict[str, torch.Tensor]) -> list[str]:
    """One row per tensor in the weights file; the same tensor of consecutive layers shares a row (`layers.{0..7}`)."""
    groups: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in state.items():
        m = re.search(r"(layers[._])(\d+)(?=[._])", name)
        key = name[:m.start(2)] + "{}" + name[m.end(2):] if m else name
        groups.setdefault(key, []).append((int(m.group(2)) if m else -1, t))
    out = ["| tensor | shape | dtype | |", "|---|---|---|---|"]
    for key, items in groups.items():
        shapes = {(tuple(t.shape), t.dtype) for _, t in items}
        ids = sorted(i for i, _ in items)
        if len(shapes) > 1 or ids != list(range(ids[0], ids[0] + len(ids))):  # not one uniform run: one row each
            rows = [(key.replace("{}", str(i)), t) for i, t in items]
        else:
            rows = [(key.replace("{}", str(ids[0]) if len(ids) == 1 else f"{{{ids[0]}..{ids[-1]}}}"), items[0][1])]
        for name, t in rows:
            note = TENSOR_NOTES.get(name, "")
            out.append(f"| `{name}` | {list(t.shape)} | {str(t.dtype).removeprefix('torch.')} | {note} |")
    return out


def _training_lines(training: dict[str, Any]) -> list[str]:
    if not training:
        return ["No training record in config.json."]
    data, tc = training.get("data") or {}, training.get("train") or {}
    data_name = data.get("path") or "sharegpt (embedded ShareGPT V3 copy)"
    out = [f"- recipe: `{training.get('recipe', '?')}`",
           f"- data: `{data_name}`"
           + (f", at most {data['max_conversations']} conversations" if data.get("max_conversations") else "")
           + (f", max length {data['max_length']}" if data.get("max_length") else "")
           + (f", system prompt {data['system_prompt']!r}" if data.get("system_prompt") else "")
           + (f" ({training['sequences']} sequences)" if training.get("sequences") else "")]
    seconds = trained_seconds(training)  # every launch of a resumed run
    run = [("steps", training.get("steps")), ("epochs", training.get("epochs")),
           ("minutes", round(seconds / 60, 1) if seconds is not None else None),
           ("tokens/s", training.get("tokens_per_s")), ("processes", training.get("processes")),
           ("distributed", {"NO": "none"}.get(training.get("distributed_type"), training.get("distributed_type"))),
           ("peak GPU MiB", training.get("peak_gpu_mib"))]
    out.append("- run: " + ", ".join(f"{k} {v}" for k, v in run if v is not None))
    loss = training.get("eagle") or training.get("layerskip") or tc  # the recipe's loss group (train.* before)
    hp = [("training-time test steps", (training.get("ttt") or {}).get("steps")),
          ("lr", tc.get("lr")), ("schedule", tc.get("schedule")), ("warmup", tc.get("warmup_steps")),
          ("batch", tc.get("batch_size")), ("grad accum", tc.get("grad_accum")), ("w_feat", loss.get("w_feat")),
          ("w_tok", loss.get("w_tok")), ("noise", loss.get("noise_std")), ("clip by value", tc.get("grad_clip_value")),
          ("precision", tc.get("mixed_precision"))]
    out.append("- hyper-parameters: " + ", ".join(f"{k} {v}" for k, v in hp if v is not None))
    if training.get("init_from"):
        out.append(f"- fine-tuned from `{training['init_from']}`")
    if training.get("final_loss") is not None:
        acc = training.get("final_acc", training.get("acc_0"))
        out.append(f"- final loss {training['final_loss']:.4f}"
                   + (f", top-1 agreement {acc:.3f}" if acc is not None else ""))
    heldout = training.get("heldout") or {}
    if heldout.get("tau") is not None:
        out.append(f"- held-out tau {heldout['tau']:.2f}"
                   + (f" over {heldout['chains']} chains" if heldout.get("chains") else "")
                   + (f", top-1 {heldout['top1']:.3f}" if heldout.get("top1") is not None else ""))
    if training.get("draft_vocab_coverage") is not None:
        out.append(f"- draft vocabulary covers {100 * training['draft_vocab_coverage']:.1f}% of training tokens")
    return out


def _results_lines(metrics: dict[str, Any], bench: Optional[dict[str, Any]], served: bool = False) -> list[str]:
    """tau (tokens committed per target pass, bonus token included; plain decoding = 1.00) and speedup."""
    if bench and bench.get("methods"):
        shown = {k: (bench[k].get("name_or_path") if isinstance(bench[k], dict) else bench[k])
                 for k in ("target", "device", "dtype", "prompts") if bench.get(k)}
        out = ["From the last benchmark (`bench.json`" + "".join(f", {k} {v}" for k, v in shown.items()) + "):", "",
               "| method | tau | tokens/s | speedup | output identical to target |", "|---|---|---|---|---|"]
        for name, m in bench["methods"].items():
            out.append(f"| {name} | {_num(m.get('tau'), 2)} | {_num(m.get('tokens_per_s'), 1)} | "
                       f"{_num(m.get('speedup'), 2, 'x')} | {_yes(m.get('identical'))} |")
        return out + ["", "tau = tokens committed per target pass over all prompts (the bonus token counts; plain "
                          "decoding = 1.00); speedup = all tokens / all seconds, against HF `generate` greedy on the "
                          "same prompts, machine and dtype, in one run."]
    if metrics.get("tau") is not None:
        keys = sorted((k for k in metrics if k.startswith("acc") and isinstance(metrics[k], float)),
                      key=lambda k: int("".join(c for c in k if c.isdigit()) or 0))  # acc@2 before acc@10
        acc = " ".join(f"{metrics[k]:.2f}" for k in keys)
        return [f"Held-out greedy drafting in training's own eval: tau {metrics['tau']:.2f} (tokens per target pass, "
                f"bonus included; plain decoding = 1.00)" + (f", acceptance by position {acc}" if acc else "") + ". "
                "That eval reads the first few held-out prompts (`train.eval_prompts`); `scripts/eval_heads.py` "
                "reads 48 and is the figure to compare heads by.",
                "Speed: in the serving engines below (selfspec's own engine among them)." if served
                else "No speed benchmark yet (`bench.json` beside the head)."]
    return ["No evaluation recorded yet."]


def _serving_lines(serving: dict[str, Any]) -> list[str]:
    """scripts/serve_bench.py's table, with the sitting it was measured in."""
    held, code = serving.get("heldout_prompts"), serving.get("code_prompts")
    prompts = (f"{serving.get('prompts', '?')} prompts"
               + (f" ({held} held-out, {code} code)" if held is not None else ""))
    sitting = [f"on {serving['date']}" if serving.get("date") else None,
               f"on {serving['machine']}" if serving.get("machine") else None,
               f"{serving['threads']} threads" if serving.get("threads") else None, prompts,
               f"{serving['max_new_tokens']} new tokens" if serving.get("max_new_tokens") else None,
               "greedy, one request at a time",
               f"chain of {serving['num_draft']}" if serving.get("num_draft") else None,
               f"llama.cpp --spec-draft-p-min {serving['draft_p_min']}" if serving.get("draft_p_min") else None,
               "every llama.cpp row with `" + " ".join(serving["llamacpp_args"]) + "`"
               if serving.get("llamacpp_args") else None,
               "llama.cpp head rows with `" + " ".join(serving["llamacpp_head_args"]) + "`"
               if serving.get("llamacpp_head_args") else None]
    return (["Measured by `scripts/serve_bench.py` in one sitting (" + ", ".join(x for x in sitting if x) + "):", ""]
            + serving["table"].strip().splitlines()
            + ["", "speedup = tokens/s against the same engine at the same precision alone, in the same sitting; "
                   "identical = outputs equal to that engine's own plain output (a bf16 difference is a near-tie "
                   "that batched verification rounds the other way)."]
            + [f"Not measured: {what} ({str(why).split(':', 1)[0]})."
               for what, why in serving.get("failed", {}).items()])


def _num(v: Any, digits: int, suffix: str = "") -> str:
    return f"{v:.{digits}f}{suffix}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _yes(v: Any) -> str:
    return "yes" if v is True else "no" if v is False else "-"


# ---------------------------------------------------------------------------------------------- usage


def _usage_lines(repo_id: str, head: dict[str, Any], target: dict[str, Any], base: Optional[str]) -> list[str]:
    """selfspec first (it loads the head by id and checks it belongs to the target), then the engines that can
    serve this head, through the exporter (publish/export.py refuses what an engine would serve wrong)."""
    args = " ".join([f"head={repo_id}", *generate_args(head, target), 'prompt="Explain KV caches."'])
    out = ["With selfspec (loads the head by id and checks it belongs to the target):", "",
           "```bash", f"selfspec generate {args}", f"python decode/generate.py {args}   # from a selfspec checkout",
           "```", ""]
    engines = _engine_lines(repo_id, head, target.get("model_type"), base or "<target>")
    if not engines:
        why = ("their DFlash loaders need the draft's own lm_head rows, and this head drafts over a reduced "
               "vocabulary through the target's (retrain with draft.vocab_size=null)" if head.get("type") == "dflash"
               else f"they have no `{head.get('type')}` draft type" if head.get("type") not in ("eagle", "eagle3") else
               "their EAGLE loaders rebuild Llama decoder layers and this head's layer is a "
               f"`{target.get('model_type')}` one (head layer=target; retrain with draft.layer=llama, the default)")
        return out + [f"No serving-engine export (vLLM, SGLang, llama.cpp) for this head: {why}. "
                      "Decode with selfspec.", ""]
    return out + ["With vLLM, SGLang or llama.cpp: convert the head with `selfspec export` (or `python "
                  "scripts/export.py`) first; their layouts differ from selfspec's, and the exporter refuses what an "
                  "engine would serve wrong.", ""] + engines


def generate_args(head: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """generate's overrides for this head: its drafter (eagle is the default) and its target (the embedded
    SmolLM2-135M is the default; conf/target/ has the tiny ones, `target=hf` any other)."""
    args = [] if head.get("type", "eagle") == "eagle" else [f"drafter={head['type']}"]
    name = str(target.get("name_or_path"))
    if name.startswith("tiny:"):
        return args + [f"target=tiny-{name.split(':', 1)[1]}"]
    if name != "embedded:smollm2-135m":
        args += ["target=hf", f"target.name_or_path={name}"]
        if target.get("revision"):
            args.append(f"target.revision={target['revision']}")
    return args


def _engine_lines(repo_id: str, head: dict[str, Any], model_type: Optional[str], base: str) -> list[str]:
    """The export + serve commands that apply to this head (publish/export.py's rules, stated for the reader)."""
    head_type, out = head.get("type"), []
    # the engines build a Llama layer: a Llama target's head, or a layer=llama head of any family (heads/eagle.py)
    llama_layer = model_type == "llama" or (head_type in ("eagle", "eagle3") and recorded_layer(head) == "llama")
    if llama_layer and model_type != "llama":
        out += [f"This head's layer is a Llama layer, so it exports for a `{model_type}` target; serving it in the "
                "engines is not yet checked for this family (engine check pending).", ""]
    sglang_flags = "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"
    if head_type == "eagle3":
        aux = head.get("aux_layers") or []
        if llama_layer and len(set(aux)) == len(aux):  # vLLM's: each layer read once
            out += ["```bash", f"selfspec export head={repo_id} format=speculators out=eagle3-head",
                    "vllm serve eagle3-head   # verifier and speculative tokens come from its config.json", "```", ""]
        if llama_layer and not head.get("norm_before_residual"):
            out += ["```bash", f"selfspec export head={repo_id} format=sglang out=sglang-head",
                    f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 "
                    f"--speculative-draft-model-path sglang-head {sglang_flags}", "```", ""]
        if llama_layer and len(head.get("aux_layers") or []) == 3:  # llama.cpp reads exactly 3 layers
            out += ["```bash", f"selfspec export head={repo_id} format=gguf out=head.gguf",
                    "llama-server -m <target.gguf> -md head.gguf --spec-type draft-eagle3 --spec-draft-n-max 5 "
                    "--spec-draft-p-min 0.5",
                    "```", ""]
        return out
    if head_type == "peagle":  # formats/peagle.py: speculators for vLLM's parallel drafter only
        return out + ["```bash", f"selfspec export head={repo_id} format=speculators out=peagle-head",
                      "vllm serve peagle-head   # parallel drafting: every speculative token from one draft pass",
                      "```", ""]
    if head_type == "dflash":  # formats/dflash.py: speculators for vLLM, z-lab's layout (SGLang, SpecForge), GGUF
        if head.get("vocab_size"):  # the engines' DFlash loaders need the draft's own lm_head rows then
            return out
        n = max(int(head.get("block_size") or 2) - 1, 1)
        out += ["```bash", f"selfspec export head={repo_id} format=speculators out=dflash-head",
                f"vllm serve {base} --speculative-config '{{\"method\": \"dflash\", \"model\": \"dflash-head\", "
                f"\"num_speculative_tokens\": {n}}}'", "```", ""]
        return out + ["```bash", f"selfspec export head={repo_id} format=gguf out=head.gguf",
                      f"llama-server -m <target.gguf> -md head.gguf --spec-type draft-dflash --spec-draft-n-max {n}",
                      "```", ""]
    if head_type != "eagle" or not llama_layer:
        return out
    if head.get("fc_bias") or head.get("vocab_size"):
        why = "an fc bias" if head.get("fc_bias") else "a reduced draft vocabulary"
        out += [f"This head has {why}, which vLLM's EAGLE-1 loader cannot express; SGLang can:", ""]
    else:
        out += ["```bash", f"selfspec export head={repo_id} format=eagle out=eagle-head", "```", "",
                "```python", "from vllm import LLM, SamplingParams",
                f"llm = LLM(model=\"{base}\", speculative_config={{\"method\": \"eagle\", \"model\": \"eagle-head\", "
                "\"num_speculative_tokens\": 5})",
                "print(llm.generate([\"Explain KV caches.\"], SamplingParams(temperature=0, max_tokens=128))"
                "[0].outputs[0].text)",
                "```", ""]
    out += ["```bash", f"selfspec export head={repo_id} format=sglang out=sglang-head",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
            f"--speculative-draft-model-path sglang-head {sglang_flags}"
            + (" --speculative-token-map sglang-head/hot_token_map.pt" if head.get("vocab_size") else ""), "```", ""]
    return out
