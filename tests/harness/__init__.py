"""Test harnesses: the fuzzer (fuzz.py), the bad-input matrix (bad_inputs.py), kill-and-resume of training
(kill_resume.py), fault injection into every writer (fault_injection.py), and the test-only drafters
(drafters.py). Tests import them as `harness.<name>` (pytest puts tests/ on sys.path); the long campaigns run
from a checkout as `python scripts/<name>.py ...`. Not collected as tests: no file here is named test_*."""
