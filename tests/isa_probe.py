"""One line naming the GEMM kernels this environment gets: the ISA oneDNN reports and MKL's own banner (MKL names its
ISA there on Intel CPUs; on others it takes one path whatever MKL_ENABLE_INSTRUCTIONS says, and the banner is the
same). `make test` compares the line under each ISA cap with the uncapped one: where they match, the capped run would
repeat the kernels the full run just took, so it is not run again there (`make test-isa` alone still runs it)."""

import os
import subprocess
import sys
from typing import Callable

PROBE = """
import torch
from selfspec.target.kernels import linear
with torch.no_grad():
    linear(torch.randn(2, 8), torch.randn(4, 8))  # oneDNN's packed inner product
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # MKL's sgemm
"""


def start(check: bool = True) -> Callable[[], tuple[str, str]]:
    """The probe started in the background: -> a call that waits for it and gives (oneDNN's ISA, MKL's banner) as a
    fresh interpreter under this environment gets them ("not used" where the library printed none); `check`: a
    probe that fails raises (else it reads as neither library used)."""
    proc = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"})

    def result() -> tuple[str, str]:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # as subprocess.run(timeout=...) does: the probe is not left running
            proc.kill()
            proc.communicate()
            raise
        if check and proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
        lines = out.splitlines()
        onednn = next((line.rsplit("isa:", 1)[1] for line in lines if ",isa:" in line), "not used")
        mkl = next((line.split(" for ", 1)[-1].rsplit(", Lnx", 1)[0] for line in lines
                    if line.startswith("MKL_VERBOSE") and " for " in line), "not used")
        return onednn, mkl

    return result


def probe(check: bool = True) -> tuple[str, str]:
    """(oneDNN's ISA, MKL's banner) under this environment: `start`, waited for."""
    return start(check)()


def kernels() -> str:
    onednn, mkl = probe()
    return f"oneDNN {onednn}; MKL {mkl}"


if __name__ == "__main__":
    print(kernels())
