"""A llama-server never outlives the run that started it (engines/llamacpp.py's Server): killed with SIGKILL, the run
takes its server with it (regenerate's engine=llamacpp and serve_bench start them). A stand-in server answers
/health, as llama-server does."""

import os
import signal
import subprocess
import sys
import textwrap
import time

FAKE_SERVER = textwrap.dedent("""\
    #!{python}
    import http.server, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)

RUN = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from selfspec.engines.llamacpp import Server
    from selfspec.engines.llamacpp import free_port
    s = Server(sys.argv[1], [], free_port(), Path(sys.argv[2]), timeout_s=60)
    print(s.proc.pid, flush=True)
    time.sleep(600)
    """)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_server_dies_with_its_run(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    run = subprocess.Popen([sys.executable, "-c", RUN, str(server), str(tmp_path / "log")], stdout=subprocess.PIPE,
                           text=True)
    pid = int(run.stdout.readline())
    assert _alive(pid)
    os.kill(run.pid, signal.SIGKILL)  # no finally, no atexit: only the kernel can stop the server now
    run.wait()
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert not _alive(pid), "the llama-server outlived the run that started it"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
