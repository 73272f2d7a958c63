"""The checkpoint group's own preflight check (and the fault-injection knobs that exercise it), called by
``fsdp_exp.preflight`` before any rank starts. Every refusal names the override that fixes it."""

from __future__ import annotations

import signal

from fsdp_exp.errors import fail


def check_checkpoint(cfg) -> None:
    """Refuse checkpoint.* and debug.fail_* values that cannot work (``cfg``: a RunConfig)."""
    c, d = cfg.checkpoint, cfg.debug
    if c.every < 0:
        fail(
            f"checkpoint.every={c.every} is negative.", "pass checkpoint.every=0 (no periodic saves) or a step interval"
        )
    if c.keep < 0:
        fail(f"checkpoint.keep={c.keep} is negative.", "pass checkpoint.keep=2 (or 0 to keep every checkpoint)")
    if not c.resume:
        fail("checkpoint.resume is empty.", "pass checkpoint.resume=auto, none, or a path to a step_<N> folder")
    if c.export not in ("none", "safetensors", "hf"):
        fail(
            f"checkpoint.export={c.export!r} is not one of none, safetensors, hf.", "pass checkpoint.export=safetensors"
        )
    if c.export == "hf":
        from fsdp_exp.models import spec_for

        problem = spec_for(cfg.model).why_no_hf_export(cfg.model)
        if problem:
            fail(
                f"checkpoint.export=hf: {problem}.",
                "pass checkpoint.export=safetensors (fsdp_exp's own parameter names)",
            )
    for name in c.signals:
        if not name.startswith("SIG") or not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
            fail(
                f"checkpoint.signals holds {name!r}, which is not a signal a process can catch.",
                "pass checkpoint.signals=[SIGTERM,SIGUSR1]",
            )
    if d.fail_signal is not None and (not d.fail_signal.startswith("SIG") or not hasattr(signal, d.fail_signal)):
        fail(f"debug.fail_signal={d.fail_signal!r} is not a signal name.", "pass debug.fail_signal=SIGKILL (or null)")
    if d.fail_during not in ("step", "save"):
        fail(f"debug.fail_during={d.fail_during!r} is not one of step, save.", "pass debug.fail_during=step")
    if d.fail_during == "save":
        if d.fail_at_step is None or c.every < 1 or d.fail_at_step % c.every or d.fail_at_step < 1:
            fail(
                f"debug.fail_during=save fails inside the save of checkpoint step_<debug.fail_at_step>, but "
                f"checkpoint.every={c.every} never saves step {d.fail_at_step}.",
                "pass checkpoint.every=N and debug.fail_at_step=<a positive multiple of N>",
            )


def check_resume_path(cfg) -> None:
    """A ``checkpoint.resume`` path must name a complete checkpoint on this disk. Asked by the launcher just
    before it starts the ranks, not in ``validate``: a sweep (or a test) validates its jobs before any has
    run, and a later job may resume from an earlier one's checkpoint. Otherwise rank 0 finds it out only after
    every rank started and built its model."""
    from fsdp_exp.checkpoint.layout import resume_refusal

    if cfg.checkpoint.resume in ("auto", "none"):
        return
    refused = resume_refusal(cfg.checkpoint.resume)
    if refused is not None:
        fail(f"{refused[0]}.", refused[1])
