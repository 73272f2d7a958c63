"""``python -m fsdp_exp.tune [the run's overrides] [tune.* options] [plan.device=<name>]``

    python -m fsdp_exp.tune model=llama70b trainer.nproc_per_node=8 trainer.nnodes=8 \\
        trainer.global_batch_size=256 trainer.seq_len=4096 plan.device=h100_80gb
    python -m fsdp_exp.tune tune.budget_gib=0.01 tune.run=true            # this CPU: predict, then measure
    python -m fsdp_exp.tune tune.calibrate_from=outputs/tune/<time>/sweep  # fit the model to a measured sweep

Predicts, for every candidate of the search space (``fsdp_exp.tune.space``), the peak memory per rank and
whether it fits (``fsdp_exp.plan``), and the step time and tokens/s (``fsdp_exp.tune.perf``); prints the
ranked table and writes ``tune.json`` in ``tune.out`` with a command that measures the top candidates and
the baselines (``fsdp_exp.tune.measure``). ``tune.run=true`` runs it and compares prediction with
measurement; ``tune.calibrate_from`` fits the model to a sweep first (``fsdp_exp.tune.calibrate``).

Exit codes: 0 done; 2 bad input (an unknown option or device, an empty space, a budget no candidate fits,
a configuration the launcher would refuse), with the fix; 1 a measured candidate had no completed run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from fsdp_exp.errors import EXIT_BAD_CONFIG, EXIT_RUN_FAILED


def tune(argv: list[str]) -> tuple[dict, int]:
    """Everything the command does but printing the table: (tune.json's content, exit status)."""
    from fsdp_exp.tune import calibrate, measure, output
    from fsdp_exp.tune.options import split_argv
    from fsdp_exp.tune.search import weigh

    opts, overrides = split_argv(argv)
    calibrated = calibrate.calibrate_from(opts.calibrate_from) if opts.calibrate_from else None
    tuning = weigh(overrides, opts)
    out = opts.out_dir()
    ids = measure.choose(tuning, opts)
    measure.write_group(tuning, ids, out)
    command = measure.sweep_command(tuning, ids, out, opts.repeats)
    plan = {
        "candidates": ids,
        "repeats": opts.repeats,
        "command": measure.shown(command),
        "sweep_dir": str((out / "sweep").resolve()),
        "config_group": str((out / "conf").resolve()),
        "calibrated": calibrated,
    }
    status = 0
    comparison = budget = None
    if opts.run:
        plan["sweep_exit_status"] = measure.run_sweep(command, to_stderr=opts.format == "json")
        measure.collect(tuning, ids, out / "sweep")
        if any(not (tuning.by_id(cid).measured or {}).get("tokens_per_s") for cid in ids):
            status = EXIT_RUN_FAILED
    elif opts.calibrate_from and not calibrate.is_published(opts.calibrate_from):
        plan["carried_from"] = str(opts.calibrate_from.parent / "tune.json")
        measure.carry_measurements(tuning, opts.calibrate_from.parent / "tune.json")
    if any(w.measured for w in tuning.candidates):
        comparison = measure.compare(tuning)
        budget = measure.budget_check(tuning)
    data = output.tune_json(tuning, argv, plan, comparison, budget)
    data["_tuning"] = tuning
    return data, status


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        from fsdp_exp.tune.options import OPTIONS

        print(__doc__)
        print("options:\n" + "\n".join(f"  {k}=...  {v}" for k, v in OPTIONS.items()))
        return 0
    from fsdp_exp.config.strict import refusal

    try:
        data, status = tune(argv)
    except Exception as err:  # noqa: BLE001 - bad input is refused; anything else is raised on
        refused = refusal(err)
        if refused is None:
            raise
        print(f"fsdp_exp.tune: {refused}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    tuning = data.pop("_tuning")
    return report(tuning, data, status, argv)


def report(tuning, data: dict, status: int, argv: list[str]) -> int:
    from rich.console import Console

    from fsdp_exp.narrow import console_lines, terminal_width
    from fsdp_exp.tune import output, recommend
    from fsdp_exp.tune.options import split_argv

    opts, _ = split_argv(argv)
    out = opts.out or Path(data["measure"]["sweep_dir"]).parent
    path = output.write_json(data, out)
    if any(w.measured for w in tuning.candidates):
        output.write_page(tuning, data, out)
    if opts.format == "json":
        print(json.dumps(data, indent=1, default=str))
        return status
    console = Console(width=terminal_width())
    width = console.width

    def say(text: str) -> None:
        """Prose wrapped at the console's width, commands broken with continuations (narrow.console_lines)."""
        for line in console_lines(text, width):
            console.print(line, highlight=False, markup=False, soft_wrap=True)

    console.print(
        f"[bold]fsdp_exp tune[/bold]: the best {min(opts.show, len(tuning.ranked))} of "
        f"{len(tuning.ranked):,} candidates that fit, by predicted tokens/s",
        highlight=False,
    )
    console.print(output.render_table(tuning, opts.show, width))
    for line in output.summary_lines(tuning):
        say(line)
    if data.get("spearman") is not None or data.get("winner", {}).get("measured"):
        winner = data["winner"]
        say(
            f"measured: Spearman {data['spearman']}, mean absolute error "
            f"{data['mae_tokens_per_s']:,.0f} tokens/s; {winner['verdict']}"
        )
    check = data.get("budget_check")
    if check:
        say(
            f"memory vs {check['limit']}: {len(check['held'])} held, {len(check['broken'])} broken, "
            f"{len(check['borderline'])} borderline; left out: {check['left_out'] or 'none'}"
        )
    say(f"wrote {path}" + (f", {out / 'tune.html'}" if (out / "tune.html").exists() else ""))
    if not opts.run:
        say(
            f"measure the top {opts.top_k} that keep {recommend.KEEP_FREE:.0%} of the memory free and the baselines "
            f"({len(data['measure']['candidates'])} candidates x {opts.repeats} runs): add tune.run=true, or run\n"
            f"  {data['measure']['command']}"
        )
    # The answer: last, where the eye lands. A command is broken only between its arguments, with shell
    # continuations: copied from a log, it is still one command.
    for line in recommend.lines(data.get("recommendation"), tuning):
        say(line)
    return status
