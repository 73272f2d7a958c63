"""What the experiment presets' comments tell a user to run: the report's path is where a sweep writes
(conf/config.yaml's hydra.sweep.dir). Issue #43 item 8: moe_ep's comment named ``multirun/<date>/<time>``,
Hydra's default, which fsdp_exp does not use."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_every_presets_report_command_reads_the_folder_sweeps_write():
    sweep_dir = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["hydra"]["sweep"]["dir"]
    prefix = sweep_dir.split("$")[0]  # outputs/sweeps/
    named = {}
    for preset in sorted((REPO / "conf" / "experiment").glob("*.yaml")):
        for path in re.findall(r"python -m fsdp_exp\.report (\S+)", preset.read_text()):
            named[preset.name] = path
            assert path.startswith(prefix), f"{preset.name} names {path}: a sweep writes {sweep_dir}"
    assert "moe_ep.yaml" in named
