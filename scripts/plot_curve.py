"""Held-out tau against training minutes, one line per trainer, from scripts/eval_heads.py reports.

    python scripts/eval_heads.py data=smollm2_regen +heads.selfspec_15=<head> +heads.eagle_15=<head> ... \
        output_file=curve.json
    python scripts/plot_curve.py +reports=[curve.json] out=docs/tau_vs_minutes.png

A head named `SERIES_LABEL` is a point of line SERIES (the name up to its last underscore; Hydra keeps `@` and `/`
for itself); its x is the training time behind its weights (its record's own, every launch of a resumed run, plus
the lineage of a head it was fine-tuned from: heads.checkpoint.lineage_seconds, which eval_heads copies into its
report as `train_seconds`), so the chunks of a chunked training make one line; its y the held-out tau with one
standard error as the bar. Heads without a training time, or named without an underscore, are left out, and said so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.core.ownership import PNG, check_output
from selfspec.core.ownership import save_png


@dataclass
class PlotCurveConfig:
    """Schema of conf/plot_curve.yaml."""

    reports: list[str] = field(default_factory=list, metadata={"help": "eval_heads output files (JSON)"})
    out: str = field(default="tau_vs_minutes.png", metadata={"help": "the PNG to write (atomically)"})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing PNG at out that this command did not write (never one of the reports).")})
    title: str = field(default="held-out tau against training minutes", metadata={"help": "the plot's title"})


def points(reports: list[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """{series: [(minutes, tau, sem), ...] sorted by minutes} from eval_heads reports."""
    series: dict[str, list[tuple[float, float, float]]] = {}
    for report in reports:
        for name, h in report["heads"].items():
            if "_" not in name or "train_seconds" not in h:
                print(f"[plot] left out '{name}': " + ("no SERIES_LABEL name" if "_" not in name else
                                                       "its record states no training time"))
                continue
            series.setdefault(name.rsplit("_", 1)[0], []).append((h["train_seconds"] / 60, h["tau"], h["sem"]))
    return {k: sorted(v) for k, v in series.items()}


@entry("plot_curve", PlotCurveConfig)
def main(cfg: PlotCurveConfig) -> dict:
    if not cfg.reports:
        raise UserError("pass +reports=[<eval_heads output>.json, ...]")
    if not str(cfg.out).endswith(".png"):
        raise UserError(f"out '{cfg.out}' must be a .png file")
    check_output(cfg.out, "out", PNG, cfg.overwrite, [(f"reports[{i}]", p) for i, p in enumerate(cfg.reports)])
    reports = []
    for path in cfg.reports:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read eval_heads report '{path}': {e}") from e
        if not isinstance(reports[-1], dict) or "heads" not in reports[-1]:
            raise UserError(f"'{path}' is not an eval_heads report (no 'heads')")
    series = points(reports)
    if not series:
        raise UserError("no head named SERIES_LABEL with a training time in these reports")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        x, y, e = zip(*pts)
        ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=name)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("held-out tau (+- 1 sem)")
    ax.set_title(cfg.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, Path(cfg.out), cfg.overwrite)  # only over a PNG selfspec wrote (core/ownership.py)
    plt.close(fig)
    result = {"out": cfg.out, "series": {k: [[round(m, 1), t, s] for m, t, s in v] for k, v in series.items()}}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
