"""Checks that need a fresh Python process (what a launch imports, what repeats across processes): moved out of
the unit tier, whose edit-test loop they slowed by a second or more each (a fresh interpreter imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO
from tests.unit.test_hf_model_specs import REPEATED_MEASUREMENT


def test_the_planners_measurement_of_a_model_repeats_itself_exactly_here_and_in_a_fresh_process():
    """The same activation measurement three times in this process and three times in a fresh one: six equal
    results (a freed storage's address, soon another's, once made a weight gradient count as alive at the
    backward peak)."""
    import contextlib
    import io

    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(REPEATED_MEASUREMENT, {})
    fresh = subprocess.run(
        [sys.executable, "-c", REPEATED_MEASUREMENT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    results = here.getvalue().splitlines() + fresh.stdout.splitlines()
    assert len(results) == 6 and len(set(results)) == 1, results


def test_the_launchers_plan_builds_the_model_without_torchs_compiler_stack(tmp_path):
    """The planner builds the model on the meta device; its initializers and rotary tables must not run torch's
    reference ops there, whose first call imports torch._dynamo and sympy (about a second of every launch). The
    step-time model's count of the work runs torch's dispatch modes, which import them too: a launch counts only
    where it has a prediction to make (a cached probe of this CPU; none in this test's empty cache)."""
    script = (
        "import sys\n"
        "from fsdp_exp.launch import prepare, run_context\n"
        "from tests.conftest import run_config\n"
        "cfg = run_config([])\n"
        "run_context(cfg, prepare(cfg), '.')\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
