"""The planner's fit search (fsdp_exp/plan/fit.py) tries every saver the planner can price, context parallel,
pipeline stages and a mixture of experts' expert parallel among them: a long sequence that only context
parallel fits is answered with ``parallel.cp``, not with "try a larger device". On the meta device."""

from __future__ import annotations

from pathlib import Path

from fsdp_exp.plan.devices import device_table, fits
from fsdp_exp.plan.fit import CP_PRICE, PRICES, _dimensions, find_fit
from fsdp_exp.plan.predict import plan
from fsdp_exp.preflight import validate
from fsdp_exp.units import GIB

from conftest import run_config

REPO = Path(__file__).resolve().parents[2]
LONG = ["model=llama3_8b", "trainer.seq_len=131072", "trainer.nproc_per_node=8"]  # 8 sequences a step


def test_a_sequence_that_fits_only_split_over_ranks_is_answered_with_context_parallel():
    cfg = run_config(LONG)
    h100 = device_table()["h100_80gb"]
    found = find_fit(cfg, validate(cfg, cuda_devices=8).dp_size, h100, 8, None)
    assert found is not None, "no fit found: the search does not try context parallel"
    changes = found["changes"]
    assert any(c.startswith("parallel.cp=") for c in changes), changes
    # each rank keeps the one sequence a micro-batch it had at cp 1, though fewer data-parallel ranks share the 8
    assert "trainer.micro_batch_size=1" in changes
    cp = int(next(c for c in changes if c.startswith("parallel.cp=")).partition("=")[2])
    priced = {f"{group}={option}": price for group, options in PRICES.items() for option, price in options.items()}
    assert found["price"] == sum(priced.get(c, 0) for c in changes) + CP_PRICE * (cp.bit_length() - 1)
    again = run_config([*LONG, *changes])  # the printed command plans as fitting
    assert fits(plan(again, validate(again, cuda_devices=8), device_kind="cuda"), h100)["fits"]
    quoted = f"fits with {' '.join(changes)}: needs {found['needed_bytes'] / GIB:.1f} of {found['device_bytes'] / GIB:.1f} GiB"
    assert quoted in " ".join((REPO / "docs" / "planning.md").read_text().split()), (
        f"docs/planning.md: quote {quoted!r}"
    )


def test_the_search_offers_context_parallel_pipeline_stages_and_for_a_mixture_of_experts_expert_parallel():
    def savers(overrides):
        cfg = run_config(overrides)
        dims = _dimensions(cfg, lambda group, option: None, validate(cfg, cuda_devices=8).dp_size)
        return {value[0].partition("=")[0] for dim in dims for value in dim if value[0]}

    dense = savers(LONG)
    assert {"parallel.cp", "parallel.pp", "trainer.nnodes"} <= dense
    assert "parallel.ep" not in dense
    moe = savers(["model=qwen3_moe_30b_a3b", "trainer.nproc_per_node=8", "trainer.global_batch_size=64"])
    assert {"parallel.cp", "parallel.pp", "parallel.ep"} <= moe
    assert "parallel.cp" not in savers([*LONG, "parallel.cp=2"])  # a degree the run chose is kept
