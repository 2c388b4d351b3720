"""Kill-and-resume as a real user would meet it: `python train/eagle.py` killed with SIGKILL (mid-checkpoint,
mid-step and during the final save), resumed with resume=auto each time, ends with the same head weights as an
uninterrupted run; no checkpoint is ever left unloadable and each resume starts from the newest complete one.
The long version is `python scripts/kill_resume.py kills=10`."""

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
