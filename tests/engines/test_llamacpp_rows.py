"""engines/llamacpp.py llamacpp_rows: a method whose llama-server aborts mid-request (llama.cpp 11434 asserts on an
EAGLE-3 draft over a Qwen2 target: its qwen2 graph keeps no layer inputs) gets no row and a one-line reason in the
engine's own words; the other methods are still measured. A stand-in server aborts like it when given a draft (-md)."""

import sys
import textwrap

import pytest

from selfspec.core.errors import UserError
from selfspec.engines.llamacpp import ServerOptions, free_port, llamacpp_rows
from selfspec.engines.methods import Method

FAKE = textwrap.dedent("""\
    #!{python}
    import http.server, json, os, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    draft = "-md" in sys.argv
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
            self.wfile.write(b"llamacpp:spec_decode_num_drafts_total 0\\n" if self.path == "/metrics" else b"{{}}")
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if draft:
                print("src/llama-graph.cpp:1413: GGML_ASSERT(t_layer_inp[il] != nullptr) failed", flush=True)
                os.abort()
            reply = {{"tokens": [7] * body["n_predict"], "timings": {{"predicted_per_second": 10.0,
                                                                     "predicted_ms": 100.0}}}}
            self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(reply).encode())
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


@pytest.fixture
def opts(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text(FAKE.format(python=sys.executable))
    server.chmod(0o755)
    return ServerOptions(str(server), 1, free_port(), 30.0, [], [], "ngram-simple")


def test_an_aborting_draft_loses_its_row_not_the_others(tmp_path, opts):
    methods = [Method("plain", "none"), Method("head", "eagle3", 3).with_head(str(tmp_path / "h.gguf")),
               Method("ngram", "ngram", 3)]
    failed = {}
    rows = llamacpp_rows(opts, tmp_path / "t.gguf", methods, [[1, 2, 3], [4, 5]], tmp_path, "f32", 4, warmup=0,
                         failed=failed)
    assert sorted(rows) == ["ngram", "plain"] and all(len(r["tokens"]) == 2 for r in rows.values())
    assert list(failed) == ["head"]
    assert "exited" in failed["head"] and "GGML_ASSERT(t_layer_inp[il] != nullptr) failed" in failed["head"]
    assert "\n" not in failed["head"]


def test_without_failed_the_abort_is_raised(tmp_path, opts):
    methods = [Method("head", "eagle3", 3).with_head(str(tmp_path / "h.gguf"))]
    with pytest.raises(UserError, match="GGML_ASSERT"):
        llamacpp_rows(opts, tmp_path / "t.gguf", methods, [[1, 2, 3]], tmp_path, "f32", 4, warmup=0)
