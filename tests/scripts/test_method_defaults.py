"""The checks that run one method by default take it from the registry (registry.FLAGSHIP) and find everything
else of it through its entry: scripts/contention.py's rows and scripts/check_gpu.py's train phase."""

from __future__ import annotations

from pathlib import Path

from entry_points import refused, run
from selfspec.registry import FLAGSHIP, method, names

ROOT = Path(__file__).resolve().parents[2]


def test_every_recipe_is_a_file_of_the_checkout_and_the_flagship_has_a_demo():
    from selfspec.scripts.check_gpu import recipe_path

    for kind in names():
        if method(kind).recipe:
            assert (ROOT / recipe_path(kind)).is_file(), kind
    assert (ROOT / "conf" / "experiment" / f"demo_{FLAGSHIP}.yaml").is_file()
    assert (ROOT / "heads" / "pretrained" / f"smollm2-135m-{FLAGSHIP}").is_dir()  # contention's hybrid row


def test_contention_rows_are_the_registrys_head_types(capsys):
    """Any head type that drafts beside a lookup may be a row; anything else is refused in one line naming them."""
    from selfspec.engines.bench import compared
    from selfspec.scripts.contention import ContentionConfig, main

    assert "layerskip" not in compared() and ContentionConfig().methods == ["plain", *compared(), "hybrid", "train"]
    assert run(main, "target=tiny-llama", "methods=[plain,medusa]") == 2
    refused(capsys, "methods ['medusa']", "a head type (" + ", ".join(compared()))
    assert run(main, "target=tiny-llama", "hybrid_head=peagle") == 2  # no P-EAGLE head ships
    refused(capsys, "hybrid_head=peagle: no shipped head of that type")


def test_the_job_beside_is_a_default_torch_job():
    """A wait policy given to the measured method is not the job's: it would yield the CPU too and flatter the row."""
    from selfspec.scripts.contention import job_env

    env = job_env({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", "PATH": "/bin", "HOME": "/root"})
    assert env == {"PATH": "/bin", "HOME": "/root"}


def test_alone_pairs_ratio_is_governed_over_fixed_speed(monkeypatch):
    """Each pair runs governed then fixed; the ratio is > 1 when the governed run was faster: tok/s governed / fixed,
    s/step fixed / governed. Median, min and max over the pairs."""
    import os
    from types import SimpleNamespace

    from selfspec.scripts import contention

    speeds = {"adaptive": iter([20.0, 22.0, 18.0]), "fixed": iter([20.0, 20.0, 20.0])}
    monkeypatch.setattr(contention, "_speed", lambda cfg, target, m: next(speeds[os.environ["SELFSPEC_THREADS"]]))
    monkeypatch.setenv("SELFSPEC_THREADS", "fixed")
    cfg = SimpleNamespace(alone_pairs=3)
    assert contention.alone_pairs(cfg, None, "plain") == {"pairs": 3, "median": 1.0, "min": 0.9, "max": 1.1}
    speeds = {"adaptive": iter([2.0, 1.6]), "fixed": iter([2.0, 2.0])}  # s/step: the governed 1.6 was faster
    cfg = SimpleNamespace(alone_pairs=2)
    assert contention.alone_pairs(cfg, None, "train") == {"pairs": 2, "median": 1.125, "min": 1.0, "max": 1.25}
