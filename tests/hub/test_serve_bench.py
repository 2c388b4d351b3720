"""scripts/serve_bench.py's checks before it starts any engine (the engines themselves: `make check-llamacpp`,
`make check-vllm`, not part of the tests)."""

import pytest
from omegaconf import OmegaConf

from selfspec.core.errors import UserError
from selfspec.scripts.serve_bench import ServeBenchConfig, check_config


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(ServeBenchConfig), {"head": "h", "engines": ["selfspec"], **kw})


@pytest.mark.parametrize("kw, message", [
    ({"engines": ["vllm"], "vllm_python": "/nonexistent/python"}, "no vLLM venv at '/nonexistent/python'"),
    ({"vllm_dtypes": ["float16"]}, "vllm_dtypes ['float16']"),
    ({"engines": ["sglang"]}, "each must be one of selfspec, llamacpp, vllm"),
    ({"head": "<set head=FOLDER>"}, "pass head="),
])
def test_refuses_before_any_engine_starts(kw, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_config(_cfg(**kw))


def test_accepts_the_vllm_engine_with_a_venv(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    check_config(_cfg(engines=["selfspec", "vllm"], vllm_python=str(python)))
