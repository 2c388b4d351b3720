"""Test harnesses: the fuzzer (fuzz.py), the bad-input matrix (bad_inputs.py), kill-and-resume of training
(kill_resume.py), fault injection into every writer (fault_injection.py), and the test-only drafters
(drafters.py). Tests import them as `harness.<name>` (pytest puts tests/ on sys.path); the long campaigns run
from a checkout as `python tests/run_harness.py <name> ...`. Not collected as tests: no file here is named test_*.
None of it ships: the wheel holds neither this folder nor a config of these harnesses."""


def entry(config_name: str, schema: type):
    """selfspec.core.cli.entry for a harness whose config is its schema alone: the schema is stored as the primary
    config `config_name` itself (conf/ holds the configs of the shipped entry points only)."""
    from hydra.core.config_store import ConfigStore

    from selfspec.core import cli

    ConfigStore.instance().store(name=config_name, node=schema)
    return cli.entry(config_name, schema)
