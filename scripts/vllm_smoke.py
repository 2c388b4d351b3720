"""Does vLLM's CPU wheel run on this CPU? Run by vLLM's own interpreter (`make vllm-smoke`, before every check that
starts vLLM; it imports nothing of selfspec): vLLM loads the kernel library its CPU build made for this instruction
set (vllm/platforms/cpu.py import_kernels: _C for AVX-512 with BF16, _C_AVX512, _C_AVX2), then two of its ops run
against torch on the same inputs. One line says which library was taken; a library this CPU cannot execute dies here
(SIGILL, issue 47's AMX lesson for llama.cpp) rather than inside a 20-minute benchmark.

    .venv-vllm/bin/python scripts/vllm_smoke.py
"""

import sys

import torch


def library() -> str:
    """The library vLLM 0.32's import_kernels picks on x86 (the same tests, in its order)."""
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2 (no AVX-512 here)"
    return "_C (AVX-512 with BF16)" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512 (AVX-512, no BF16)"


def main() -> int:
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    torch.manual_seed(0)
    x, weight = torch.randn(4, 64), torch.rand(32) + 0.5
    out = torch.empty(4, 32)
    torch.ops._C.silu_and_mul(out, x)
    expected = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]
    normed = torch.empty(4, 32)
    torch.ops._C.rms_norm(normed, x[:, :32].contiguous(), weight, 1e-6)
    want = x[:, :32] * torch.rsqrt(x[:, :32].pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    worst = max((out - expected).abs().max().item(), (normed - want).abs().max().item())
    if worst > 1e-4:  # fp32 ops on the same inputs: only rounding may differ
        print(f"error: vLLM {vllm.__version__}'s CPU kernels ({library()}) disagree with torch by {worst:.2e} on "
              "this CPU; its results here cannot be trusted", file=sys.stderr)
        return 1
    print(f"[vllm] {vllm.__version__} CPU kernels {library()} run here: silu_and_mul and rms_norm match torch "
          f"(max diff {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
