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

from selfspec.target.model import EMBEDDED
from selfspec.heads.checkpoint import trained_seconds
from selfspec.heads.layers import recorded_layer
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
    diagram, rows = getattr(_card_module(head_type), "section", _unknown)(head, target, state)
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


def _card_module(head_type: str):
    """The head type's card module (Method.card: `section`, and `serving` / `unserved` where engines apply), or None
    for a type no method registers."""
    return method(head_type).load("card") if head_type in names() else None


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


def shape(state: dict[str, torch.Tensor], name: str, default: tuple) -> tuple:
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


def _minutes(seconds) -> Optional[float]:
    return round(seconds / 60, 1) if isinstance(seconds, (int, float)) else None


def _training_lines(training: dict[str, Any]) -> list[str]:
    if not training:
        return ["No training record in config.json."]
    data, tc = training.get("data") or {}, training.get("train") or {}
    data_name = data.get("path") or "sharegpt (embedded ShareGPT V3 copy)"
    out = [f"- recipe: `{training.get('recipe', '?')}`",
           f"- data: `{data_name}`"
           + (f", conversations matching `{data['match']}`" if data.get("match") else "")
           + (f", after the first {data['skip_conversations']}" if data.get("skip_conversations") else "")
           + (f", at most {data['max_conversations']} conversations" if data.get("max_conversations") else "")
           + (f", max length {data['max_length']}" if data.get("max_length") else "")
           + (f", system prompt {data['system_prompt']!r}" if data.get("system_prompt") else "")
           + (f" ({training['sequences']} sequences)" if training.get("sequences") else "")]
    seconds = trained_seconds(training)  # every launch of a resumed run
    run = [("steps", training.get("steps")), ("epochs", training.get("epochs")),
           ("minutes", _minutes(seconds)),
           ("minutes before, in the head it continued", _minutes(training.get("init_train_seconds"))),
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
        own = _card_module(head.get("type"))
        why = (own.unserved(head, target) if hasattr(own, "unserved")
               else f"they have no `{head.get('type')}` draft type")
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
    # the engines build a Llama layer: a Llama target's head, or a layer=llama head of any family (heads/layers.py)
    layered = head_type in names() and method(head_type).layered  # a `layer` option (heads/layers.py LAYERS)
    llama_layer = model_type == "llama" or (layered and recorded_layer(head) == "llama")
    if llama_layer and model_type != "llama":
        out += [f"This head's layer is a Llama layer, so it exports for a `{model_type}` target; serving it in the "
                "engines is not yet checked for this family (engine check pending).", ""]
    serving = getattr(_card_module(head_type), "serving", None)  # the method's own commands, if it has any
    return out + serving(repo_id, head, base, llama_layer) if serving else out
