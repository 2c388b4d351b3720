"""A stand-in for target/vllm_worker.py's vLLM side, for tests that run without vLLM (CI has no .venv-vllm).

Same protocol (`--version`; then a spec line and JSON-line requests) and vLLM's conventions, computed with
transformers on the spec's HF folder: hidden_states column j = the state after layers[j] decoder layers, ids sorted,
the last layer WITHOUT the final norm; files of {hidden_states [T, L, H], token_ids}. Misbehaviours on demand, to
test the client's guards: FAKE_VLLM_VERSION (what --version reports; "none" = not installed), FAKE_VLLM_SHORT=1
(states one row short, as chunked prefill gives), FAKE_VLLM_TOKENS=1 (saved token ids off by one), FAKE_VLLM_FAIL=1
(the engine does not start).
"""

import json
import os
import sys

if sys.argv[1:2] == ["--version"]:
    v = os.environ.get("FAKE_VLLM_VERSION", "0.32.0")
    print(json.dumps({"vllm": None if v == "none" else v}))
    sys.exit(0)

reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def send(obj):
    reply.write(json.dumps(obj) + "\n")
    reply.flush()


import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

spec = json.loads(sys.stdin.readline())
if os.environ.get("FAKE_VLLM_FAIL"):
    print("RuntimeError: no CPU for you", file=sys.stderr)
    send({"error": "RuntimeError: no CPU for you"})
    sys.exit(0)
dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.get("dtype", "float32")]
model = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=dtype).eval()
layers = sorted(set(spec["layers"])) if spec.get("layers") is not None else None
send({"ready": True, "vllm": os.environ.get("FAKE_VLLM_VERSION", "0.32.0")})
count = 0
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "close":
        break
    if request["op"] == "generate":
        tokens = []
        for ids in request["prompts"]:
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=request["max_tokens"], do_sample=False,
                                 eos_token_id=request["stop_token_ids"] or None, pad_token_id=0)[0, len(ids):].tolist()
            stops = set(request["stop_token_ids"])
            end = next((i for i, t in enumerate(out) if t in stops), None)
            tokens.append(out if end is None else out[:end + 1])
        send({"tokens": tokens, "seconds": 0.0})
        continue
    files = []
    for ids in request["prompts"]:
        last = {}
        hook = model.get_decoder().layers[-1].register_forward_hook(
            lambda mod, args, out: last.update(h=out[0] if isinstance(out, tuple) else out))
        with torch.no_grad():
            hs = model.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        hook.remove()
        n = len(hs) - 1
        cols = [last["h"][0] if k == n else hs[k][0] for k in layers]  # vLLM: the last layer un-normed
        states = torch.stack(cols, dim=1)  # [T, L, H]
        saved = list(ids)
        if os.environ.get("FAKE_VLLM_SHORT"):
            states = states[:-1]
        if os.environ.get("FAKE_VLLM_TOKENS"):
            saved = [saved[0]] + [t + 1 for t in saved[1:]]
        path = os.path.join(spec["storage"], f"{count}.safetensors")
        count += 1
        os.makedirs(spec["storage"], exist_ok=True)
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(saved)}, path)
        files.append(path)
    send({"files": files, "seconds": 0.0})
