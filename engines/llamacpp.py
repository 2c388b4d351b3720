"""llama.cpp's server as a benchmark engine: the target converted by llama.cpp's own converter, heads exported by
publish/ (and the same head through the converter, to compare byte for byte), one llama-server per configuration.

tau: llama-server (`--metrics`) counts draft tokens, accepted draft tokens and `spec_decode_num_drafts_total` =
verification steps that carried a draft; tau = 1 + accepted / drafts, read as deltas around each request (llama.cpp's
own "mean len"). Steps with no draft are left out (an n-gram drafter, or a head under p_min, often has none), so
each row also keeps `steps` = verification steps of every kind (generated tokens - accepted drafts) and `step_s` =
the server's own decode time (timings.predicted_ms: no prompt processing, no HTTP), which engines/costs.py reads.
"""

from __future__ import annotations

import hashlib
import http.client
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

from selfspec.core.errors import UserError
from selfspec.engines.methods import Method, record_prompt, rotated


@dataclass
class ServerOptions:
    binary: str  # the llama-server binary (make check-llamacpp builds it)
    threads: int = 2  # -t
    port: int = 8097  # servers listen on 127.0.0.1:port, port+1, ...
    timeout_s: float = 180.0  # wait this long for a server to load
    args: list[str] = field(default_factory=list)  # more arguments for every server
    head_args: list[str] = field(default_factory=list)  # more arguments for the heads' servers
    ngram: str = "ngram-simple"  # llama.cpp's n-gram drafter (--spec-type)
    ngram_match: Optional[int] = None  # its n-gram kinds' match length (None: llama.cpp's default; ngram_args)
    ngram_draft: Optional[int] = None  # their most tokens drafted (None: llama.cpp's default)
    suffix: list[str] = field(default_factory=list)  # our build's suffix kind's flags (suffix_args; [] its defaults)


# convert_hf_to_gguf.py with a BPE pre-tokenizer named for it where it knows none: its table knows released models'
# tokenizers by a hash of their output, and a tiny target that borrows another model's vocabulary is none of them.
# The converter's own answer wins wherever it has one. argv: the tree, the name, then the converter's arguments.
CONVERT_NAMING_PRE = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
from conversion.base import TextModel
known, pre = TextModel.get_vocab_base_pre, sys.argv[2]


def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return pre


TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert_hf_to_gguf.main()
"""


def target_gguf_path(work: Path, folder: Path, outtype: str) -> Path:
    """Where a work folder keeps the target GGUF converted from the HF folder `folder` at `outtype`: named by that
    folder (its resolved path, each file's name, size and modification time), so that a run over another target, or
    over this one changed since, converts anew instead of serving what an earlier run converted (convert_target reuses
    a file present). One per precision: the folder's other target GGUFs of `outtype` are removed."""
    h = hashlib.sha256(str(folder.resolve()).encode())
    for p in sorted(folder.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"\0{p.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    out = work / f"target-{h.hexdigest()[:12]}-{outtype}.gguf"
    for stale in (work / f"target-{outtype}.gguf", *work.glob(f"target-*-{outtype}.gguf")):
        if stale != out and stale.is_file():
            stale.unlink()
    return out


def convert_target(src: Path, pythonpath: str, folder: Path, outtype: str, out: Path,
                   pre_tokenizer: Optional[str] = None) -> Path:
    """The target's HF folder -> GGUF with llama.cpp's own converter (cached: reused when present). `pre_tokenizer`:
    llama.cpp's name for the folder's BPE pre-tokenizer where the converter does not recognise it (CONVERT_NAMING_PRE);
    None: the converter's refusal stands."""
    if out.exists():
        return out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), pythonpath]))
    tmp = out.with_name(out.name + ".tmp")
    args = [str(folder), "--outtype", outtype, "--outfile", str(tmp)]
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), *args] if pre_tokenizer is None else \
        [sys.executable, "-c", CONVERT_NAMING_PRE, str(src), pre_tokenizer, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"convert_hf_to_gguf.py ({outtype}) failed: {p.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, out)
    return out


def converter_head(src: Path, pythonpath: str, record, state, target_config, target_folder: Path, outtype: str,
                   out: Path) -> Path:
    """The same head through llama.cpp's converter (convert_hf_to_gguf.py --target-model-dir) from the folder it
    reads (the head type's registry entry, `converter`: speculators for EAGLE-3, the z-lab / SpecForge layout
    (format=sglang) for DFlash and DSpark)."""
    from selfspec.publish.export import convert, write_export
    from selfspec.registry import method

    fmt = method(record["head"]["type"]).converter
    with tempfile.TemporaryDirectory(prefix="selfspec-spec-") as tmp:
        folder = write_export(convert(record, state, target_config, fmt), record, Path(tmp) / "head")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), pythonpath]))
        p = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--target-model-dir",
                            str(target_folder), "--outtype", outtype, "--outfile", str(out)],
                           env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"convert_hf_to_gguf.py (head, {outtype}) failed: {p.stderr.strip().splitlines()[-1:]}")
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when the process that started it dies, however it
    dies (a `kill`, an OOM kill), so no llama-server outlives its run holding cores and memory (Linux only)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """One llama-server on 127.0.0.1 for one configuration, stopped after the measurement."""

    def __init__(self, binary: str, args: list[str], port: int, log: Path, timeout_s: float,
                 env: tuple[tuple[str, str], ...] = ()):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.f = open(log, "w")
        self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), *args],
                                     stdout=self.f, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                     env={**os.environ, **dict(env)} if env else None)
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

    def complete(self, ids: list[int], n: int, cache_prompt: bool = False, **sampling) -> dict:
        """Continue the token ids `ids` by up to `n` tokens: greedy unless `sampling` (temperature, top_p, seed...)
        says otherwise. The reply's `tokens` end with the end-of-generation token where it stopped at one."""
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": cache_prompt,
                "return_tokens": True, "stream": False, **sampling}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except (OSError, http.client.HTTPException) as e:  # the server died mid-request (an engine abort)
            raise UserError(self.died(e)) from None
        out["wall_s"] = time.perf_counter() - t0
        return out

    def died(self, e: BaseException) -> str:
        """One line on a request that failed: the engine's own words (an assert, an error line) where it exited."""
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return f"llama-server did not answer ({type(e).__name__}: {e}); log {self.log}"
        lines = self.log.read_text(errors="replace").splitlines()
        said = [ln.strip() for ln in lines if "GGML_ASSERT" in ln or " E " in ln or "error" in ln.lower()]
        return (f"llama-server exited {self.proc.returncode} during a request: "
                f"{said[-1][:300] if said else 'no error line'} (log {self.log})")

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


# llama.cpp 11434's n-gram kinds: their flags for the length matched and the most tokens drafted (common/arg.cpp).
# Each kind drafts up to its own length whatever --spec-draft-n-max says; ngram-cache has no such flags (8 tokens).
NGRAM_FLAGS = {"ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m"),
               "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"),
               "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m"),
               "ngram-mod": ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max")}
# every lookup a llama.cpp row can draft with (the n-gram row's --spec-type, a hybrid's first): the n-gram kinds,
# ngram-cache, and our build's suffix drafter (scripts/llamacpp-suffix.patch)
LOOKUP_KINDS = (*NGRAM_FLAGS, "ngram-cache", "suffix")


def ngram_args(kind: str, match: Optional[int], draft: Optional[int]) -> list[str]:
    """The flags that set n-gram kind `kind`'s match length and its most drafted tokens (None: llama.cpp's default,
    a 12-token match and 48 drafted for ngram-simple and the maps, 24 and 48-64 for ngram-mod: sized for long
    agentic contexts, where a short answer rarely repeats 12 tokens). ngram-mod's shortest draft
    (--spec-ngram-mod-n-min, 48 by default) goes to 1 with `draft`, so that it drafts what it finds, as the other
    kinds do."""
    if kind not in NGRAM_FLAGS:
        return []
    n_flag, m_flag = NGRAM_FLAGS[kind]
    out = [n_flag, str(match)] if match is not None else []
    if draft is not None:
        out += [m_flag, str(draft)] + (["--spec-ngram-mod-n-min", "1"] if kind == "ngram-mod" else [])
    return out


def suffix_args(depth: int, min_prob: float, alpha: float, num_draft: int, min_match: int = 1) -> list[str]:
    """The flags of our build's `--spec-type suffix` (scripts/llamacpp-suffix.patch: SuffixDecoding's drafter) for
    selfspec's suffix knobs (decode/drafters LookupConfig), so that its suffix rows draft as selfspec's and vLLM's
    (engines/vllm_engine.suffix_knobs) do; `min_match`, llama.cpp's alone: the shortest match that drafts."""
    return ["--spec-suffix-depth", str(depth), "--spec-suffix-min-prob", f"{min_prob:g}", "--spec-suffix-alpha",
            f"{alpha:g}", "--spec-suffix-n-max", str(num_draft), "--spec-suffix-min-match", str(min_match)]


def server_args(opts: ServerOptions, target_gguf: Path, m: Method) -> list[str]:
    """llama-server's arguments for one method: the head's GGUF as the draft model (--spec-type draft-<head type>; a
    block head's pass decodes the anchor + num_draft masks), or the n-gram drafter (its lengths: ngram_args, the
    method's own where it has them, else the options'), or our build's suffix drafter (its knobs: opts.suffix).
    A hybrid's lookup is one of them."""
    base = ["-m", str(target_gguf), "-t", str(opts.threads), "-c", "4096", "-np", "1", "--metrics", "--no-webui",
            *opts.args]
    if m.kind == "none":
        return base
    spec = ["--spec-draft-n-max", str(m.num_draft), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(m.p_min)]
    kind = "suffix" if m.kind == "suffix" else m.lookup or opts.ngram
    lookup = list(opts.suffix) if kind == "suffix" else ngram_args(
        kind, *(m.ngram_lengths or (opts.ngram_match, opts.ngram_draft)))
    if m.kind in ("ngram", "suffix"):
        return base + ["--spec-type", kind] + spec + lookup
    if m.kind == "hybrid":  # llama.cpp tries its drafters in turn (n-gram kinds first): the head drafts what the
        # n-gram cannot (common/speculative.cpp, common_speculative_draft: the first non-empty draft is verified)
        return base + ["-md", str(m.head), "--spec-type", f"{kind},draft-{m.base}"] + spec + lookup \
            + list(opts.head_args)
    return base + ["-md", str(m.head), "--spec-type", f"draft-{m.kind}"] + spec + list(opts.head_args)


def server_log(work: Path, label: str, m: Method, tag: str = "") -> Path:
    """Where llama-server's output for method `m` goes (`tag`: "-costs" for the pass-cost runs)."""
    name = re.sub(r"[^\w+.-]", "", m.name.replace(" ", "_"))  # "eagle3 head + lookup, llama.cpp's own"
    return work / f"server-{label}-{name}{tag}.log"


def _record(run: dict[str, Any], j: int, first: bool, out: dict[str, Any], d: dict[str, float], share: float) -> None:
    """One request of prompt j into its method's run, its time and counters each a `share` (1 / repeats) of the
    prompt's means; the first request's tokens are kept, a later one's compared with them."""
    got = {"accepted": d.get("spec_decode_num_accepted_tokens_total", 0.0) * share,
           "drafts": d.get("spec_decode_num_drafts_total", 0.0) * share}
    p = record_prompt(run, j, first, list(out["tokens"]), out["wall_s"], share, {k: 0.0 for k in got})
    for k, v in got.items():
        p[k] += v
    run["decode_tps"].append(out["timings"]["predicted_per_second"])
    run["step_s"] += out["timings"].get("predicted_ms", 0.0) / 1e3 * share
    run["accepted"] += got["accepted"]
    run["drafts"] += got["drafts"]
    run["drafted"] += d.get("spec_decode_num_draft_tokens_total", 0.0) * share


def llamacpp_rows(opts: ServerOptions, target_gguf: Path, methods: list[Method], prompts: list[list[int]], work: Path,
                  label: str, max_new_tokens: int, warmup: int = 1,
                  failed: dict[str, str] | None = None, repeats: int = 1) -> dict[str, dict[str, Any]]:
    """One server per method, all up at once (an idle llama-server takes no CPU), each request timed alone; the
    prompts go to the methods in turn, the order rotated per prompt, so this VM's drift hits every row alike.
    `repeats` > 1 serves every prompt that many times per method (all prompts once, then again, the rotation going
    on): a prompt's seconds and counters are its requests' means, and its tokens the first request's, which
    every later one must repeat (else it counts as differing: `repeats_differ`).
    A method whose server will not start or dies (an engine abort) gets no row: `failed[name]` says why, in the
    engine's own words, and the other methods go on (without `failed`, the first failure is raised)."""
    if repeats < 1:
        raise UserError(f"repeats {repeats}: must be >= 1")
    servers: dict[str, Server] = {}
    runs = {m.name: {"tokens": [], "seconds": [], "decode_tps": [], "step_s": 0.0, "accepted": 0.0, "drafts": 0.0,
                     "drafted": 0.0, "per_prompt": [], "repeats_differ": 0} for m in methods}

    def fail(name: str, e: UserError) -> None:
        if failed is None:
            raise e
        failed[name] = str(e)
        print(f"[serve-bench] llama.cpp {label} {name}: {e}", flush=True)
        if name in servers:
            servers.pop(name).stop()

    try:
        for i, m in enumerate(methods):
            try:
                servers[m.name] = Server(opts.binary, server_args(opts, target_gguf, m), opts.port + i,
                                         server_log(work, label, m), opts.timeout_s, m.env)
                for ids in prompts[:warmup]:
                    servers[m.name].complete(ids, 8)
            except UserError as e:
                fail(m.name, e)
        for r in range(repeats):
            for j, ids in enumerate(prompts):
                for name in rotated([m.name for m in methods if m.name in servers], r, j, len(prompts)):
                    srv, run = servers[name], runs[name]
                    m0 = srv.metrics()
                    try:
                        out = srv.complete(ids, max_new_tokens)
                    except UserError as e:
                        fail(name, e)
                        continue
                    m1 = srv.metrics()
                    _record(run, j, r == 0, out, {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}, 1 / repeats)
    finally:
        for srv in servers.values():
            srv.stop()
    starts = {name: srv.start_s for name, srv in servers.items()}
    rows = {}
    for m in methods:
        if failed is not None and m.name in failed:
            continue
        run = runs[m.name]
        accepted, drafts, drafted = run["accepted"], run["drafts"], run["drafted"]
        n = sum(len(t) for t in run["tokens"])
        rows[m.name] = {"tokens": run["tokens"], "seconds": run["seconds"],
                        "tau": 1.0 + accepted / drafts if drafts else (1.0 if m.kind == "none" else None),
                        "counters": {"drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
                                     "acceptance_rate": round(accepted / drafted, 4) if drafted else None},
                        "steps": n - accepted, "step_s": run["step_s"], "verified_tokens": n - accepted + drafted,
                        "server_decode_tok_s": round(sum(run["decode_tps"]) / len(run["decode_tps"]), 2),
                        "start_s": round(starts[m.name], 1), "num_draft": m.num_draft, "p_min": m.p_min,
                        **({"lookup": m.lookup} if m.lookup else {}),
                        **({"ngram_lengths": list(m.ngram_lengths)} if m.ngram_lengths else {}),
                        "per_prompt": run["per_prompt"],
                        **({"repeats": repeats, "repeats_differ": run["repeats_differ"]} if repeats > 1 else {})}
    return rows


def pass_costs(opts: ServerOptions, target_gguf: Path, prompts: list[list[int]], work: Path, label: str,
               Ms: list[int], context_tokens: int = 200, repeats: int = 5, decode_tokens: int = 64) -> dict[str, Any]:
    """The target's pass costs in llama-server (ms, the server's own timings: no HTTP): pass[M] = prompt
    processing of M new tokens after a cached context of `context_tokens` (cache_prompt; each repeat a different
    tail), c1 = decode time per generated token. Prompt processing computes logits at the last position only, a
    verification pass at all M (as llama-bench's pp figures in docs/cost_model.md)."""
    ids = [t for p in prompts for t in p]
    need = context_tokens + max(Ms) + repeats
    ids = (ids * (1 + need // max(len(ids), 1)))[:need]
    m = Method("plain", "none")
    srv = Server(opts.binary, server_args(opts, target_gguf, m), opts.port, server_log(work, label, m, "-costs"),
                 opts.timeout_s)
    try:
        ctx = ids[:context_tokens]
        srv.complete(ctx, 1, cache_prompt=True)
        pass_ms, seen = {}, {}
        for M in Ms:
            times = []
            for r in range(repeats):
                srv.complete(ctx, 1, cache_prompt=True)  # back to the context alone
                t = srv.complete(ctx + ids[context_tokens + r: context_tokens + r + M], 1, cache_prompt=True)["timings"]
                times.append(t["prompt_ms"])
                seen.setdefault(M, set()).add(t["prompt_n"])
            pass_ms[M] = round(min(times), 3)  # the least disturbed by other jobs on the host
        t = srv.complete(ids[:context_tokens + 1], decode_tokens, cache_prompt=False)["timings"]
        c1 = t["predicted_ms"] / max(t["predicted_n"], 1)
    finally:
        srv.stop()
    # prompt_n: the tokens the server processed (M when the context was reused as asked)
    return {"c1_ms": round(c1, 3), "pass_ms": pass_ms, "context_tokens": context_tokens,
            "prompt_n": {M: sorted(v) for M, v in seen.items()}}
