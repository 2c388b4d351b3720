"""Kill-and-resume as a real user would meet it: `python methods/eagle/train.py` killed with SIGKILL (mid-checkpoint,
mid-step and during the final save), resumed with resume=auto each time, ends with the same head weights as an
uninterrupted run; no checkpoint is ever left unloadable and each resume starts from the newest complete one.
The long version is `python tests/run_harness.py kill_resume kills=10`."""

from __future__ import annotations

from harness import kill_resume as kr


def test_sigkilled_training_resumes_to_identical_weights(tmp_path):
    # 24 steps of batches of 2 over ~21 sequences (kill_resume's default run): resumed runs go on into later
    # epochs over sequences they saw before the resume point (online features kept in RAM must not matter)
    result = kr.run_campaign(kills=3, seed=0, steps=24, save_every=3, modes=["step", "checkpoint", "final"],
                             save_pause=0.4, work_dir=tmp_path, launch_timeout=300, log=lambda *_: None,
                             warm=True)
    table = kr.table(result)
    assert not result["problems"], f"{result['problems']}\n{table}"
    assert result["kills"] == 3, table
    assert any(r.during_save for r in result["rows"]), table  # at least one kill landed inside a checkpoint write
    assert result["identical"], table


def test_a_warm_child_runs_and_dies_like_a_process(tmp_path):
    """The warm Python's started children (what the kill tests launch): output in its files, line by line under
    PYTHONUNBUFFERED while it runs, its exit code, and -9 once SIGKILLed mid-run."""
    import os
    import time

    from harness.warm_python import WarmPython

    script = tmp_path / "child.py"
    script.write_text("import sys, time\nprint('started')\ntime.sleep(float(sys.argv[1]))\nsys.exit(3)\n")
    python = WarmPython(dict(os.environ), preload=False)
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        done = python.start(str(script), ["0"], tmp_path, env, tmp_path / "a.out", tmp_path / "a.err", 30)
        assert done.wait() == 3 and (tmp_path / "a.out").read_text() == "started\n"
        slow = python.start(str(script), ["60"], tmp_path, env, tmp_path / "b.out", tmp_path / "b.err", 90)
        deadline = time.time() + 20
        out = tmp_path / "b.out"
        while not (out.exists() and out.read_text() == "started\n"):  # printed while the child still runs
            assert slow.poll() is None and time.time() < deadline
            time.sleep(0.01)
        slow.kill()
        assert slow.wait() == -9
    finally:
        python.close()
