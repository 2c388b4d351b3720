"""Serving engines as benchmark engines: selfspec's own (selfspec_engine.py), llama.cpp's server (llamacpp.py) and
vLLM's CPU build (vllm_engine.py), each running the methods of methods.py (plain, a head, n-gram) over the same
prompts; report.py makes their table, costs.py the cost model of docs/cost_model.md. bench.py holds the serving
benchmark's config and one runner per engine; scripts/serve_bench.py drives them. Imports core, data, heads, decode
and publish; nothing imports engines but scripts."""
