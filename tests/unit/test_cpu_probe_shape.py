"""The CPU probe prices bf16 at a Llama block of the run's own shape (issue #34 item 7): on this machine class a bf16
block gains ~1x fp32's rate at width 128 and ~3x at 1024, so one fixed width misprices every other model."""

from __future__ import annotations

from fsdp_exp.tune.probe import DEFAULT_SHAPE, _entry_key, block_shape, bounded_shape, probe_key
from tests.conftest import run_config


def test_the_probed_block_takes_the_models_width_and_two_of_its_sequences_within_bounds():
    assert block_shape(run_config(["model.dim=128", "model.n_heads=4", "trainer.seq_len=128"])) == (128, 256)
    # capped: a probe must stay short on a CPU
    assert bounded_shape(4096, 2 * 4096) == (1024, 512)
    assert bounded_shape(16, 2 * 16) == (64, 64)
    assert bounded_shape(200, 300) == (192, 288)  # multiples of 32


def test_each_block_shape_is_cached_apart_and_the_calibration_key_holds_no_shape():
    small, large = _entry_key(2, 1, (128, 256)), _entry_key(2, 1, DEFAULT_SHAPE)
    assert small != large and small.startswith(probe_key(2, 1)) and "block 128 x 256" in small
    assert "block" not in probe_key(2, 1)
