"""docs/context_parallel.md's "When CP pays" table is today's planner and step-time model: each row's layout
(Llama-3 8B, 8 H100 80GB, bf16, FSDP2 full, one sequence a micro-batch, 8 a step) planned on the meta device and
timed by ``fsdp_exp.tune.step_time.predict``, its need per rank, whether it fits and its tokens/s per GPU as the
page prints them. A change to either model that moves a figure fails here; the page is then updated."""

from __future__ import annotations

import re
from pathlib import Path

from fsdp_exp.plan import plan
from fsdp_exp.plan.devices import DEVICES, fits
from fsdp_exp.preflight import validate
from fsdp_exp.tune.step_time import predict

from conftest import run_config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "context_parallel.md"
H100 = DEVICES["h100_80gb"]
BASE = [
    "model=llama3_8b",
    "model.max_seq_len=131072",
    "trainer.nproc_per_node=8",
    "precision=bf16",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=1",
]
ROW = re.compile(r"^\| (\d+)K \| ac=(\w+), (.+?) \| (.*?) \| (.*?) \|\s*(.*?)\s*\|$")


def table() -> list[tuple[str, ...]]:
    """The rows of the section's table, as the page writes them."""
    section = PAGE.read_text().split("## When CP pays", 1)[1].split("\n## ", 1)[0]
    return [m.groups() for m in map(ROW.match, section.splitlines()) if m]


def layout(text: str) -> list[str]:
    """'cp 8 (ring)', 'tp 2 x cp 4 (ring)', 'tp 2, cp 1', 'cp 8' -> the overrides."""
    method = re.search(r"\((\w+)\)", text)
    tp = re.search(r"tp (\d+)", text)
    cp = re.search(r"cp (\d+)", text)
    return [
        f"parallel.tp={tp.group(1) if tp else 1}",
        f"parallel.cp={cp.group(1) if cp else 1}",
        *([f"parallel.cp_method={method.group(1)}"] if method else []),
    ]


def test_the_when_cp_pays_table_is_what_the_planner_and_step_time_model_say_today():
    rows = table()
    assert len(rows) >= 10
    for seq, ac, parallel, peak, fit, tokens in rows:
        cfg = run_config([*BASE, f"trainer.seq_len={int(seq) * 1024}", f"ac={ac}", *layout(parallel)])
        topology = validate(cfg, cuda_devices=8)
        planned = plan(cfg, topology, device_kind="cuda")
        fitting = fits(planned, H100)["fits"]
        got = (
            f"{planned.per_rank_bytes['total'] / 2**30:.1f} GiB",
            "yes" if fitting else "no",
            f"{predict(cfg, topology, H100.perf).tokens_per_s / 8:,.0f}" if fitting else "",
        )
        assert got == (peak, fit, tokens), f"{seq}K ac={ac}, {parallel}: the page says {(peak, fit, tokens)}"
