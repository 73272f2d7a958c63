"""The run's console (fsdp_exp/record/console.py) without a process group: a resumed run's bar starts at its
resumed step, and an evaluation step prints its validation loss on a line of its own."""

from __future__ import annotations

from fsdp_exp.record.console import ConsoleSink


def _row(step: int, **extra) -> dict:
    return {"step": step, "train/loss": 3.0, "perf/tokens_per_s": 1000.0, **extra}


def test_a_resumed_runs_progress_bar_starts_at_the_resumed_step():
    sink = ConsoleSink(1000, progress=True, summary_table=False, start_step=500)
    assert sink.bar.n == 500 and sink.bar.format_dict["initial"] == 500  # 500/1000 at once, no rate from 0
    sink.log(_row(510))
    assert sink.bar.n == 510
    sink.close()


def test_an_evaluation_step_prints_the_validation_loss(capsys):
    sink = ConsoleSink(20, progress=False, summary_table=False)
    sink.log(_row(5))
    sink.log(_row(10, **{"val/loss": 2.71828, "val/perplexity": 15.15}))
    sink.close()
    out = capsys.readouterr().out
    assert "step 10: validation loss 2.7183, perplexity 15.15" in out and "step 5:" not in out
