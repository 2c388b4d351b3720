"""scripts/regenerate.py engine=llamacpp: the records come from a llama-server with parallel slots, each prompt its
own request. A stand-in server (answers /health and /completion, logs its argv and every request) replaces
llama-server; the real one is run by the Qwen2.5-Coder-1.5B data recipe (data/regenerated/README.md)."""

import json
import os
import sys
import textwrap

import pytest

from selfspec.scripts import regenerate

FAKE = textwrap.dedent("""\
    #!{python}
    import http.server, json, os, sys
    log = os.environ["FAKE_LLAMA_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(log, "a") as f:
                f.write(json.dumps(body) + "\\n")
            reply = {{"tokens": [body["prompt"][-1]] * body["n_predict"], "stop_type": "limit"}}
            self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(reply).encode())
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    server = tmp_path / "llama-server"
    server.write_text(FAKE.format(python=sys.executable))
    server.chmod(0o755)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    return server, log


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_llamacpp_engine_writes_a_record_per_conversation(tmp_path, fake_server):
    server, log = fake_server
    out = tmp_path / "regen.jsonl"
    base = ["target=tiny-llama", "data=tiny", "data.max_conversations=5", f"data.cache_dir={tmp_path}",
            "engine=llamacpp", f"llamacpp_server={server}", f"llamacpp_gguf={tmp_path / 'model.gguf'}",
            "max_new_tokens=4", "max_turns=1", "batch_size=4", "llamacpp_slots=2"]
    summary = regenerate.main([*base, f"out={out}"])
    assert summary["written"] == 5 and summary["engine"] == "llamacpp"
    for row in _lines(out):
        assert [m["role"] for m in row["messages"] if m["role"] != "system"] == ["user", "assistant"]
    argv, *requests = _lines(log)
    args = argv["argv"]
    assert args[args.index("-np") + 1] == "2" and args[args.index("-m") + 1] == str(tmp_path / "model.gguf")
    assert len(requests) == 5
    assert all(r["n_predict"] == 4 and r["temperature"] == 0 and r["top_k"] == 1 and "seed" not in r
               for r in requests)
    assert (tmp_path / "regen.jsonl.llama-server.log").exists()

    log.unlink()
    sampled = regenerate.main([*base, f"out={tmp_path / 'sampled.jsonl'}", "temperature=0.7", "seed=3"])
    assert sampled["written"] == 5
    requests = _lines(log)[1:]
    assert all(r["temperature"] == 0.7 and r["top_k"] == 0 for r in requests)
    assert sorted(r["seed"] for r in requests) == [3, 4, 5, 6, 7]  # one draw sequence per request, from seed


@pytest.mark.parametrize("bad,message", [
    ("llamacpp_server={tmp}/none", "no llama-server at"),
    ("llamacpp_gguf={tmp}/none.gguf", "is not a file"),
    ("llamacpp_gguf=null", "pass llamacpp_gguf=<the GGUF of target 'tiny:llama'>"),
    ("llamacpp_slots=0", "llamacpp_slots must be >= 1"),
])
def test_llamacpp_engine_bad_options_touch_nothing(tmp_path, fake_server, capsys, bad, message):
    server, log = fake_server
    out = tmp_path / "regen.jsonl"
    argv = ["target=tiny-llama", "data=tiny", f"data.cache_dir={tmp_path}", f"out={out}", "engine=llamacpp",
            f"llamacpp_server={server}", f"llamacpp_gguf={tmp_path / 'model.gguf'}", bad.format(tmp=tmp_path)]
    with pytest.raises(SystemExit) as e:
        regenerate.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("error: ") and message in err, err
    assert not out.exists() and not os.path.exists(f"{out}.llama-server.log") and not log.exists()
