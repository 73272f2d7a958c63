"""The console: a progress bar during the run and a summary table at the end (rank 0)."""

from __future__ import annotations

from typing import Any


class ConsoleSink:
    def __init__(self, total_steps: int, progress: bool, summary_table: bool, start_step: int = 0):
        """``start_step``: the step a resumed run continues from, where its bar starts (not at 0)."""
        from tqdm import tqdm

        self.summary_table = summary_table
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not progress,
        )

    def log(self, metrics: dict) -> None:
        self.bar.set_postfix(
            loss=f"{metrics['train/loss']:.4f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}", refresh=False
        )
        self.bar.update(metrics["step"] - self.bar.n)
        if metrics.get("val/loss") is not None:  # an evaluation step (trainer.eval_every): a line of its own
            self.bar.write(
                f"step {metrics['step']}: validation loss {metrics['val/loss']:.4f}, "
                f"perplexity {metrics.get('val/perplexity', float('nan')):.4g}"
            )

    def summary(self, summary: dict, title: str) -> None:
        self.bar.close()
        if not self.summary_table:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=True, header_style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in summary.items():
            table.add_row(key.removeprefix("summary/"), _fmt(value))
        Console().print(table)

    def close(self) -> None:
        self.bar.close()


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
