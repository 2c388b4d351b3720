"""The tiny target families (target/tiny.py) in the serving engines: scripts/check_engine_families.py.

Per family: the tiny target saved as an HF folder (with a tokenizer llama.cpp's converter accepts), a head of each
recipe trained a few steps in-process (train/tiny.py), exported in the format each engine loads (vLLM:
EAGLE-1 as format=eagle, EAGLE-3 and DFlash as format=speculators; llama.cpp: EAGLE-3 and DFlash as format=gguf),
then each engine's plain greedy output and its output with each head (fp32 / F32, through engines/vllm_engine.py and
engines/llamacpp.py) and the draft counters that engine reports. A cell is one (family, engine, head): ok (loaded, ran,
output identical to the same engine's plain output, drafted/accepted counted) or a one-line reason why not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

from selfspec.core.errors import UserError, first_line
from selfspec.registry import method, names, serving

ENGINES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
# The tiny targets borrow SmolLM2's tokenizer, which llama.cpp's converter knows ('smollm'), but transformers loads a
# qwen2 folder's tokenizer as Qwen2Tokenizer whatever its tokenizer_config says (qwen2 is one of its
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), with Qwen2's own pre-tokenizer regex over that vocabulary: a tokenizer no
# released model has, so the converter refused the folder ("BPE pre-tokenizer was not recognized") before any engine
# ran. Tokenizer class -> llama.cpp's name for the regex that class applies (llama-vocab.cpp's QWEN2 regex is the
# class's), which the converter writes where it knows none (engines/llamacpp.py CONVERT_NAMING_PRE). The engines are
# given token ids, so the name only decides how llama.cpp would split text, as transformers does.
PRE_TOKENIZERS = {"Qwen2Tokenizer": "qwen2"}
PROMPTS = ["Tell me about speculative decoding: how a small draft model proposes tokens and the target verifies them.",
           "Write a short poem about the sea."]


def served(engine: str) -> dict[str, str]:
    """head type -> the export format `engine` loads (methods/: Method.engines; llama.cpp has no EAGLE-1 draft), for
    the head types trained on tiny targets (Method.tiny: not P-EAGLE)."""
    return {name: fmt for name, fmt in serving(engine).items() if method(name).tiny is not None}


def columns() -> list[tuple[str, str]]:
    return [(e, h) for e in ENGINES for h in ("plain", *served(e))]


def save_target(family: str, folder: Path, tokenizer: Optional[str], head_dim: int = 0, num_layers: int = 0) -> Path:
    """tiny:<family> (target/tiny.py) as an HF folder. `tokenizer`: a target whose tokenizer it takes instead of the
    byte-level one (e.g. embedded:smollm2-135m; its vocabulary sizes the model, and its tokenizer_class is written
    as GPT2Tokenizer, the class of the original, which the Phi-3 converter asks for), None keeps the byte-level one.
    `head_dim` > 0: attention heads of that size (hidden 64 / head_dim heads, half as many KV heads; vLLM's CPU
    attention has no kernel for target/tiny.py's head_dim 16), 0 keeps the tiny config's; `num_layers` > 0 the same
    for its 2 layers."""
    from transformers import AutoTokenizer

    from selfspec.target.model import local_folder
    from selfspec.target.tiny import build_tiny_target

    shape = dict(num_attention_heads=64 // head_dim, num_key_value_heads=max(32 // head_dim, 1),
                 head_dim=head_dim) if head_dim else {}
    shape |= {"num_hidden_layers": num_layers} if num_layers else {}
    if (folder / "config.json").exists():  # reused (its heads too) only if it has this shape
        saved = json.loads((folder / "config.json").read_text())
        if any(saved.get(k) != v for k, v in shape.items()):
            raise UserError(f"'{folder}' holds a target of another shape than {shape}: use another work_dir")
        return folder
    if tokenizer is None:
        model, tok = build_tiny_target(family, **shape)
    else:
        tok = AutoTokenizer.from_pretrained(str(local_folder(tokenizer)))
        model, _ = build_tiny_target(family, vocab_size=64 * ((len(tok) + 63) // 64), bos_token_id=tok.bos_token_id,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape)
        model.generation_config.pad_token_id = tok.pad_token_id
    model.config._name_or_path = str(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if tokenizer is not None:
        cfg = folder / "tokenizer_config.json"
        cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"tokenizer_class": "GPT2Tokenizer"}, indent=2))
    return folder


def prompts(tok) -> list[list[int]]:
    from selfspec.target.model import chat_prompt_ids

    return [chat_prompt_ids(tok, [{"role": "user", "content": p}]) for p in PROMPTS]


def cell(plain: Optional[dict], row: Optional[dict] = None, reason: Optional[str] = None) -> dict[str, Any]:
    """One (family, engine, head) result from the engine's rows (tokens, counters): loaded, prompts identical to the
    engine's plain output, drafted / accepted tokens and drafts (verification steps that carried a draft)."""
    if reason is not None or row is None:
        return {"loaded": False, "reason": first_line(reason or "not run")}
    c = row.get("counters") or {}
    same = sum(a == b for a, b in zip(row["tokens"], plain["tokens"])) if plain else None
    return {"loaded": True, "identical": same, "prompts": len(row["tokens"]),
            "tokens": sum(len(t) for t in row["tokens"]), "drafts": int(c.get("drafts") or 0),
            "drafted": int(c.get("draft_tokens") or 0), "accepted": int(c.get("accepted") or 0),
            "output": [list(t) for t in row["tokens"]]}


def _generic(c: dict[str, Any], model_type: Optional[str]) -> dict[str, Any]:
    if not model_type or "reason" not in c:
        return c
    return c | {"reason": c["reason"].replace(f"'{model_type}'", "'<model_type>'")}


def cell_text(c: dict[str, Any], reasons: list[str]) -> str:
    """A table cell: `ok 2/2 =, 7/90 acc.` (prompts identical to the engine's plain output, accepted / drafted
    tokens), `DIFFERS 1/2 = (gap g; HF k/2), ...` (g: the HF fp32 logit gap where it differs, k: prompts equal to
    HF's own greedy), a plain cell `ok (HF k/2)`, or `refused (n)` / `no (n)` with n the reason's number in
    `reasons` (appended when new)."""
    if not c.get("loaded"):
        if c["reason"] not in reasons:
            reasons.append(c["reason"])
        return f"{'refused' if c['reason'].startswith('export refused') else 'no'} ({reasons.index(c['reason']) + 1})"
    hf = [f"HF {c['hf_identical']}/{c['prompts']}"] if "hf_identical" in c else []
    if c.get("plain"):
        return "ok" + "".join(f" ({h})" for h in hf)
    if c["identical"] == c["prompts"]:
        return f"ok {c['identical']}/{c['prompts']} =, {c['accepted']}/{c['drafted']} acc."
    gaps = [abs(d["fp32_gap"]) for d in c.get("divergences", []) if "fp32_gap" in d]
    why = ([f"gap {max(gaps):g}"] if gaps else []) + hf
    return (f"DIFFERS {c['identical']}/{c['prompts']} =" + (f" ({'; '.join(why)})" if why else "")
            + f", {c['accepted']}/{c['drafted']} acc.")


def table(results: dict[str, dict[str, dict[str, Any]]],
          types: Optional[dict[str, str]] = None) -> tuple[str, list[str]]:
    """{family: {"<engine> <head>": cell}} -> (markdown table, the numbered reasons of its "no" cells). `types`
    (family -> model_type): a reason that names the family's model type says '<model_type>' instead, so families
    refused for one cause share its number."""
    reasons: list[str] = []
    results = {f: {k: _generic(c, (types or {}).get(f)) for k, c in cells.items()} for f, cells in results.items()}
    head = ["family"] + [f"{ENGINES[e]} {h}" for e, h in columns()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, cells in results.items():
        row = [family]
        for e, h in columns():
            c = cells.get(f"{e} {h}")
            row.append("—" if c is None else cell_text(c | ({"plain": True} if h == "plain" else {}), reasons))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines), reasons


# What names an engine's failure in its log, best first: a Python exception (vLLM), a ggml assertion or abort
# (llama.cpp), an error-level llama.cpp line, any line saying error or failed (llama.cpp's "normal" warnings skipped).
LOG_PATTERNS = [r"^\w+(Error|Exception): ", r"GGML_ASSERT|GGML_ABORT", r"^[\d.]+ E ", r"\b(error|failed)\b"]


def log_reason(log: Path) -> Optional[str]:
    """The first line of an engine's own error in its log (LOG_PATTERNS), paths cut to their file names."""
    if not log.exists():
        return None
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "this warning is normal" not in ln]
    for k, pattern in enumerate(LOG_PATTERNS):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:  # the last exception (the one that ended vLLM), else the first line of its kind
            line = re.sub(r"^[\d.]+ [A-Z] ", "", hits[-1] if k == 0 else hits[0])
            return first_line(re.sub(r"(?<![\w.])/\S*/", "", line))
    return None


def _heads(folder: Path, fam_dir: Path, recipes: list[str], train_head: Callable, log) -> dict[str, Any]:
    """recipe -> (record, state) of its trained head (`train_head(target folder, recipe, out)`: train/tiny.py's), or
    the one-line reason it has none."""
    from selfspec.heads.checkpoint import read_head

    out: dict[str, Any] = {}
    for r in recipes:
        try:
            out[r] = read_head(str(train_head(folder, r, fam_dir / r)))
        except UserError as e:
            out[r] = first_line(str(e))
        log(f"{fam_dir.name} {r}: {'trained' if isinstance(out[r], tuple) else out[r]}")
    return out


def _export(head, config, fmt: str, out: Path, num_draft: int, target_gguf: Optional[Path] = None):
    from selfspec.publish.export import convert, to_gguf, write_export, write_gguf

    if isinstance(head, str):
        raise UserError(head)
    record, state = head
    try:
        if fmt == "gguf":
            return write_gguf(to_gguf(record, state, config, "f32"), record, out.with_suffix(".gguf"), target_gguf)
        return write_export(convert(record, state, config, fmt, num_draft), record, out, overwrite=True)
    except UserError as e:
        raise UserError(f"export refused: {e}") from e


def _engine_cells(engine: str, run, heads: dict, export, log) -> dict[str, dict]:
    """An engine's plain cell and a cell per head type it serves: `run(Method)` -> rows or raises UserError,
    `export(head type, format)` -> what that engine loads."""
    from selfspec.engines.methods import Method

    def attempt(m: Method):
        try:
            return run(m), None
        except UserError as e:
            return None, first_line(str(e))

    plain, why = attempt(Method("plain", "none"))
    cells = {f"{engine} plain": cell(None, plain, why)}
    for h, fmt in served(engine).items():
        if h not in heads:
            continue
        try:
            draft = export(h, fmt)
        except UserError as e:
            cells[f"{engine} {h}"] = cell(None, reason=str(e))
        else:
            row, why2 = (None, f"plain {ENGINES[engine]} did not run: {why}") if plain is None else attempt(
                Method(f"{h} head", h, 3, 0.0, str(draft)))
            cells[f"{engine} {h}"] = cell(plain, row, why2)
        log(f"{ENGINES[engine]} {h}: " + str({k: v for k, v in cells[f"{engine} {h}"].items() if k != "output"}))
    return cells


def vllm_cells(cfg, folder: Path, fam_dir: Path, heads: dict, ps, log) -> dict[str, dict]:
    from transformers import AutoConfig

    from selfspec.engines.vllm_engine import vllm_rows

    config = AutoConfig.from_pretrained(folder)

    def run(m):
        try:
            return vllm_rows(cfg.vllm_python, fam_dir / "vllm-cache", fam_dir, str(folder), ps, "float32", m,
                             cfg.max_new_tokens, cfg.max_model_len)
        except (UserError, OSError) as e:  # OSError: the worker's pipe broke
            why = log_reason(fam_dir / f"vllm-float32-{m.name.replace(' ', '_')}-n{m.num_draft}.log")
            raise UserError(why or str(e)) from e

    return _engine_cells("vllm", run, heads, lambda h, fmt: _export(heads[h], config, fmt, fam_dir / f"{h}-{fmt}", 3),
                         log)


def llamacpp_cells(cfg, folder: Path, fam_dir: Path, heads: dict, ps, log) -> dict[str, dict]:
    from transformers import AutoConfig, AutoTokenizer

    from selfspec.engines.llamacpp import ServerOptions, convert_target, llamacpp_rows, server_log, target_gguf_path

    config = AutoConfig.from_pretrained(folder)
    pre = PRE_TOKENIZERS.get(type(AutoTokenizer.from_pretrained(folder)).__name__)
    try:
        gguf = convert_target(Path(cfg.llamacpp_src), cfg.llamacpp_pythonpath, folder, "f32",
                              target_gguf_path(fam_dir, folder, "f32"), pre)  # the target saved this run
    except UserError as e:  # no target to serve; a head that did not train says so itself
        why = cell(None, reason=str(e))
        return {f"llamacpp {h}": cell(None, reason=heads[h]) if isinstance(heads.get(h), str) else why
                for h in ("plain", *served("llamacpp")) if h == "plain" or h in heads}
    opts = ServerOptions(cfg.llamacpp_server, cfg.threads, cfg.port, cfg.server_timeout_s)

    def run(m):
        try:
            return llamacpp_rows(opts, gguf, [m], ps, fam_dir, "f32", cfg.max_new_tokens, 1)[m.name]
        except (UserError, OSError) as e:  # OSError: the server died during a request
            raise UserError(log_reason(server_log(fam_dir, "f32", m)) or f"{type(e).__name__}: {e}") from e

    return _engine_cells("llamacpp", run, heads,
                         lambda h, fmt: _export(heads[h], config, fmt, fam_dir / f"{h}-{fmt}", 3, gguf), log)


def run_family(cfg, family: str, work: Path, train_head: Callable, log=print) -> dict[str, dict]:
    """Every cell of one family (cfg: scripts/check_engine_families.py's config; train_head: see _heads);
    work/<family>/ keeps the target folder, heads, exports, GGUFs and engine logs."""
    from transformers import AutoTokenizer

    fam_dir = work / family
    fam_dir.mkdir(parents=True, exist_ok=True)
    folder = save_target(family, fam_dir / "target", None if cfg.tokenizer == "tiny" else cfg.tokenizer,
                         cfg.head_dim, cfg.num_layers).resolve()
    ps = prompts(AutoTokenizer.from_pretrained(folder))
    recipes = [h for h in names() if any(h in served(e) for e in cfg.engines)]
    heads = _heads(folder, fam_dir, recipes, train_head, log)
    cells: dict[str, dict] = {}
    for engine in cfg.engines:
        cells.update((vllm_cells if engine == "vllm" else llamacpp_cells)(cfg, folder, fam_dir, heads, ps, log))
    add_references(cells, folder, ps, cfg.max_new_tokens)
    return cells


def add_references(cells: dict[str, dict], folder: Path, ps: list[list[int]], max_new_tokens: int) -> None:
    """Each engine output beside the HF fp32 target's own greedy tokens (`hf_identical`: prompts equal to them, up to
    where the engine stopped), and each output that differs from its engine's plain output gets its divergence
    (engines/report.py: the first differing position and the HF fp32 logit gap there: a near-tie is what an engine's
    kernel order flips)."""
    import torch

    from selfspec.target.model import load_target
    from selfspec.engines.report import divergence

    if not any(c.get("loaded") for c in cells.values()):
        return
    try:
        target = load_target(str(folder))
    except UserError:  # a family load_target refuses (qwen3_next): no reference
        return
    ref = []
    for p in ps:
        ids = torch.tensor([p])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                    pad_token_id=target.tokenizer.pad_token_id or 0)
        ref.append(out[0, len(p):].tolist())
    for name, c in cells.items():
        if not c.get("loaded"):
            continue
        c["hf_identical"] = sum(list(r[: len(o)]) == list(o) for r, o in zip(ref, c["output"]))
        if name.endswith(" plain") and c["hf_identical"] < len(ref):  # where the engine's own decoding leaves HF's
            c["hf_divergences"] = [divergence(target, ps[i], r, o) | {"prompt": i}
                                   for i, (r, o) in enumerate(zip(ref, c["output"])) if list(r[: len(o)]) != list(o)]
        plain = cells.get(name.split()[0] + " plain", {})
        if c.get("identical") not in (None, c.get("prompts")) and plain.get("loaded"):
            c["divergences"] = [divergence(target, ps[i], a, b) | {"prompt": i}
                                for i, (a, b) in enumerate(zip(plain["output"], c["output"])) if a != b]


def rescore(cfg, results: dict[str, dict[str, dict]], work: Path) -> None:
    """The HF references and divergences (add_references) of a finished run's cells, from its saved targets."""
    from transformers import AutoTokenizer

    for family, cells in results.items():
        folder = (work / family / "target").resolve()
        add_references(cells, folder, prompts(AutoTokenizer.from_pretrained(folder)), cfg.max_new_tokens)
