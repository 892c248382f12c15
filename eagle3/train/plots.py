"""Training curves as a PNG: loss per optimizer step, and held-out acceptance length / per-step accuracy."""

from __future__ import annotations

import json
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def plot_curves(log_path: Path, eval_path: Path, out: Path) -> Path | None:
    """Write ``out`` (PNG) from the JSONL logs; None when there is nothing to plot."""
    steps, evals = _lines(Path(log_path)), _lines(Path(eval_path))
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eagle3.durable import atomic_path

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([s["step"] for s in steps], [s["loss"] for s in steps], lw=1)
    left.set(title="training loss (weighted over TTT steps)", xlabel="optimizer step", ylabel="loss")
    if evals:
        x = [e["step"] for e in evals]
        right.plot(x, [e["acceptance_length"] for e in evals], marker="o", label="acceptance length", color="black")
        right.set(title="held-out", xlabel="optimizer step", ylabel="expected acceptance length")
        twin = right.twinx()
        for k in range(len(evals[0]["accuracy"])):
            twin.plot(x, [e["accuracy"][k] for e in evals], lw=1, alpha=0.7, label=f"acc step {k}")
        twin.set_ylabel("accuracy")
        twin.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    return Path(out)
