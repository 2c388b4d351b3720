"""Self-distillation records: the target rewrites the assistant turns of conversations, into an append-only JSONL
file (what scripts/regenerate.py runs).

For each conversation, every assistant turn is regenerated given the earlier turns AS REGENERATED (so a later
answer follows the target's own earlier answers), in batches with left padding (hf_generate), as one unpadded
batch of token ids per turn through vLLM (vllm_generate, target/vllm_worker.py), or as parallel requests to a
llama-server serving the target's GGUF (llamacpp_generate). A record is one OpenAI-shape line per conversation,
{"id", "messages": [{role, content}]}, with the source's id.

The output file is appended to, never rewritten: each line is one complete record, and each batch is flushed and
fsynced, so a kill loses at most the batch in flight and never a record already written. On resume, ids already
written are skipped, and a torn last line left by an interrupted run is dropped first (a complete last record whose
newline was not written yet is kept and its newline added). One run at a time holds the file (lock_file: an
exclusive lock on the file itself: two runs appending to one file would write every conversation twice).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from selfspec.core.errors import UserError


def lock_file(f, path: Path) -> None:
    """Hold an exclusive lock on the open output file for the run's life (the kernel drops it when the process
    dies), or refuse in one line: another run is appending to it."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"out '{path}' is being written by another regenerate run; wait for it to finish or pass "
                        "another out=") from None


def generation_kwargs(tokenizer, template: str, max_new_tokens: int, temperature: float,
                      top_p: float) -> dict[str, Any]:
    """transformers `generate` keyword arguments: greedy at temperature 0, else sampled; stopping at the template's
    end-of-turn ids (hf_generate and vllm_generate read them)."""
    from selfspec.data.tokenize import end_of_turn_ids

    return dict(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0,
        eos_token_id=end_of_turn_ids(tokenizer, template),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **({"temperature": temperature, "top_p": top_p} if temperature > 0 else
           {"temperature": None, "top_p": None, "top_k": None}),
    )


def hf_generate(model, generation: dict[str, Any], device):
    """transformers' `generate` on a batch of prompts (token id lists) -> each prompt's new tokens (after a stop
    token come pads)."""
    import torch

    def run(prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        pad = generation["pad_token_id"]
        # Left padding: every prompt ends at the same column, so generated tokens line up.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, T]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generation)
        return generated[:, width:].tolist()

    return run


def vllm_generate(worker, cfg, generation: dict[str, Any]):
    """The same through vLLM: greedy or sampled like `generation`, stopping at the same end-of-turn ids only (the
    sampler's seed is the engine's, VllmWorker(seed=): one per request would give every prompt the same draws)."""
    def run(prompts: list[list[int]]) -> list[list[int]]:
        return worker.generate(prompts, cfg.max_new_tokens, temperature=cfg.temperature,
                               top_p=cfg.top_p if cfg.temperature > 0 else 1.0,
                               stop_token_ids=generation["eos_token_id"])

    return run


def llamacpp_generate(server, cfg):
    """The same through a llama-server with `cfg.batch_size` parallel slots (engines/llamacpp.py's Server): each
    prompt is its own request, sent together, so the server batches them (continuous batching). Greedy or sampled
    (its own sampler, seeded per request from cfg.seed); it stops at the GGUF's end-of-generation tokens, which end
    the reply's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    sampling = {} if cfg.temperature == 0 else {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    calls = iter(range(1 << 62))

    def one(ids: list[int]) -> list[int]:
        seed = {"seed": cfg.seed + next(calls)} if sampling else {}
        return list(server.complete(ids, cfg.max_new_tokens, **sampling, **seed)["tokens"])

    def run(prompts: list[list[int]]) -> list[list[int]]:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, prompts))

    return run


def regenerate_all(cfg, tokenizer, template: str, generate, max_prompt: int, todo, f) -> dict[str, Any]:
    """Regenerate `todo` in batches, appending a line per conversation to `f`; returns the totals."""
    from tqdm import tqdm

    from selfspec.data.tokenize import end_of_turn_ids

    totals: dict[str, Any] = {"written": 0, "tokens": 0, "cut_turns": 0, "dropped": 0, "engine": cfg.engine}
    stops = set(end_of_turn_ids(tokenizer, template))
    t0 = time.time()
    with tqdm(total=len(todo), unit="conv", desc="regenerating") as bar:
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start: start + cfg.batch_size]
            results = regenerate_batch(generate, tokenizer, template, [r["messages"] for r in batch], stops,
                                       max_prompt, totals, cfg.max_turns)
            for row, messages in zip(batch, results):
                if any(m["role"] == "assistant" for m in messages):
                    # One write of a whole line, then flush: an interruption can only tear the last line.
                    f.write(json.dumps({"id": row["id"], "messages": messages}, ensure_ascii=False) + "\n")
                    totals["written"] += 1
                else:
                    totals["dropped"] += 1  # its first prompt alone was longer than max_prompt_tokens
            f.flush()
            os.fsync(f.fileno())  # the batch's records survive a crash of the machine, not only of the process
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{totals['tokens'] / max(time.time() - t0, 1e-9):.1f}")
    totals["seconds"] = round(time.time() - t0, 1)
    return totals


def regenerate_batch(generate, tokenizer, template: str, conversations: list[list[dict[str, str]]], stops: set[int],
                     max_prompt: int, totals: dict[str, int], max_turns: Optional[int] = None):
    """Rewrite the assistant turns of several conversations, turn by turn: `generate(prompts)` (hf_generate or
    vllm_generate) continues a batch of token id lists. Returns the new message lists."""
    # Normalised conversations are [system?] (user, assistant)+: keep the system turn, replay the user turns.
    histories = [[m for m in conv[:1] if m["role"] == "system"] for conv in conversations]
    users = [[m["content"] for m in conv if m["role"] == "user"][:max_turns] for conv in conversations]
    alive = [True] * len(conversations)
    for turn in range(max((len(u) for u in users), default=0)):
        active, prompts = [], []
        for k, history in enumerate(histories):
            if not alive[k] or turn >= len(users[k]):
                continue
            messages = history + [{"role": "user", "content": users[k][turn]}]
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt:
                alive[k] = False
                continue
            active.append(k)
            prompts.append(ids)
        if not active:
            break
        for k, row in zip(active, generate(prompts)):
            end = next((i for i, t in enumerate(row) if t in stops), None)
            answer = row[:end] if end is not None else row
            totals["tokens"] += len(answer) + (end is not None)
            histories[k] += [{"role": "user", "content": users[k][turn]},
                             {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}]
            if end is None:  # cut at max_new_tokens: later turns would answer a history it never finished
                totals["cut_turns"] += 1
                alive[k] = False
    return histories


def resume_ids(path: Path) -> set[str]:
    """Ids already written to `path`. A last line without its newline is either a complete record (kept, and its
    newline added so the next record starts a line of its own) or a torn one (the previous run was interrupted
    while writing it: cut off the file). Any other unreadable line is refused rather than guessed at."""
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0  # byte offset just after the last complete line
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            record = _record(line)
            if not line.endswith(b"\n"):
                if record is not None:  # complete: only its newline is missing
                    done.add(str(record["id"]))
                    with open(path, "ab") as g:
                        g.write(b"\n")
                        g.flush()
                        os.fsync(g.fileno())
                    return done
                break  # the torn tail: dropped below
            if record is None:
                raise UserError(f"{path}:{lineno}: not a line this script writes; pass a new out= file")
            done.add(str(record["id"]))
            good_end += len(line)
    if good_end < path.stat().st_size:
        print(f"[selfspec] {path}: dropping a torn last line left by an interrupted run "
              f"({path.stat().st_size - good_end} bytes)", flush=True)
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done


def _record(line: bytes) -> Optional[dict]:
    """A line's {"id", "messages"} record, or None if it is not a whole one. A JSON object cut short is never
    valid JSON, so a torn line cannot pass for a complete record."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or "id" not in record or not isinstance(record.get("messages"), list):
        return None
    return record


NOT_IDENTITY = ("out", "batch_size", "skip", "data.max_conversations", "data.num_proc", "data.cache_dir",
                "target.cache_dir", "vllm_python", "llamacpp_server", "llamacpp_slots")
# What a key meant in a config written before the key existed (a file regenerated before engine= was hf's).
BEFORE = {"engine": "hf"}


def check_same_run(cfg, out: Path) -> None:
    """A non-empty out= is continued only by the run that made it: the `<out>.config.yaml` its first launch wrote
    must agree with this config on every key that shapes a record (the target, the data, sampling), else refused
    in one line naming the first key that differs (train/run.py's rule for output_dir). Its config must be one
    selfspec wrote (core/ownership.py). A file from before configs were written first is continued, and said."""
    from omegaconf import OmegaConf

    from selfspec.core.cli import config_path, flatten
    from selfspec.core.ownership import Kind, check_output, config_kind

    side = config_path(out)
    check_output(out, "out", Kind("regenerate output", folder=False, mine=lambda p: True),
                 inputs=[("data.path", cfg.data.path)])
    check_output(side, "out's config", config_kind(cfg))
    if not out.exists() or out.stat().st_size == 0:
        return
    if not side.exists():
        print(f"[selfspec] {out} has no {side.name} saying how its records were made (an older selfspec): "
              "continuing it as this run's", flush=True)
        return
    try:
        recorded = OmegaConf.to_container(OmegaConf.load(side), resolve=True)  # resolved, as this run's
    except Exception as e:  # YAML or interpolation errors of a damaged file
        raise UserError(f"'{side}' (how the records in '{out}' were made) is unreadable ({type(e).__name__}); "
                        "pass another out=") from e
    ours = flatten(OmegaConf.to_container(cfg, resolve=True))
    theirs = flatten(recorded if isinstance(recorded, dict) else {})
    for key in [*ours, *theirs]:
        if any(key == n or key.startswith(n + ".") for n in NOT_IDENTITY):
            continue
        if ours.get(key, "absent") != theirs.get(key, BEFORE.get(key, "absent")):
            raise UserError(f"out '{out}' holds records made with {key}={theirs.get(key, 'absent')} ({side.name}), "
                            f"this run has {key}={ours.get(key, 'absent')}: pass another out=, or the same settings "
                            "to resume it")
