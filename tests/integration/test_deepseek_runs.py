"""DeepSeek-V3's architecture (multi-head latent attention, a dense first block, group-limited sigmoid routing with
a routed scaling and a shared expert: model=deepseek_v3_tiny) trained for real on 4 gloo ranks.

One spawned group trains it at parallel.ep=1, 2 and 4 through fsdp_exp's own recipe (test_expert_parallel's
``_train``): the same losses and expert gradients within 1e-5 in fp32. A launched run at ep=2 with a rank
SIGKILLed resumes bit for bit (and under context parallel with the same losses), and its end-of-run export (checkpoint.export=hf) loads in transformers'
DeepseekV3ForCausalLM with the logits of the run's last checkpoint."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TINY_BATCH
from test_expert_parallel import _free_port, _train

OVERRIDES = ["model=deepseek_v3_tiny", *TINY_BATCH, "trainer.nproc_per_node=4", "trainer.warmup_steps=1"]
STEPS = 4
EPS = (1, 2, 4)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from conftest import run_config
    from fsdp_exp.preflight import validate

    results = {}
    for ep in EPS:
        cfg = run_config([*OVERRIDES, f"trainer.steps={STEPS}", f"parallel.ep={ep}"])
        results[ep] = _train(cfg, validate(cfg, cuda_devices=0), torch.device("cpu"), STEPS)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_deepseek_v3_tiny_trains_at_ep_1_2_and_4_with_the_same_losses_and_expert_gradients(tmp_path):
    mp.spawn(_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4)
    results = torch.load(tmp_path / "results.pt")
    base_losses, base_grads = results[1]
    print({ep: results[ep][0] for ep in EPS})
    assert all(torch.isfinite(torch.tensor(base_losses))) and base_losses[-1] < base_losses[0]
    for ep in EPS[1:]:
        losses, grads = results[ep]
        for a, b in zip(losses, base_losses):
            assert abs(a - b) < 1e-5, (ep, losses, base_losses)
        for step, (g, g1) in enumerate(zip(grads, base_grads)):
            assert set(g) == set(g1) and len(g) == 6  # w1, w2, w3 of the 2 routed layers (block 0 is dense)
            for name in g:
                torch.testing.assert_close(g[name], g1[name], rtol=1e-4, atol=1e-6, msg=f"ep={ep} {step} {name}")


@pytest.mark.slow
@pytest.mark.timeout(900)  # three launches of 4 ranks on 2 cores: 8.8 min at load 30
def test_a_killed_rank_resumes_bit_identically_and_the_export_loads_in_transformers_deepseek_v3(tmp_path):
    """ep=2, checkpoints every 2 steps, rank 2 SIGKILLed after step 3: the rerun resumes from step 2 and logs step
    3 as the first attempt did; the step-2 checkpoint resumed at cp=2 gives the same losses within 1e-5. The
    export (Hugging Face names and config) gives transformers' logits equal to the model of the step-4 checkpoint,
    the loss-free bias (trained, nonzero) included."""
    transformers = pytest.importorskip("transformers")
    from fsdp_exp.export import load_checkpoint_model, model_config
    from fsdp_exp.launch import RunFailed
    from fsdp_exp.models import build_meta, spec_for

    from conftest import read_metrics, run_experiment

    overrides = [
        *OVERRIDES,
        "trainer.steps=4",
        "parallel.ep=2",
        "checkpoint.every=2",
        "checkpoint.export=hf",
        "logger.wandb.mode=disabled",
    ]
    with pytest.raises(RunFailed) as failed:
        run_experiment([*overrides, "debug.fail_at_step=3", "debug.fail_rank=2", "debug.fail_signal=SIGKILL"], tmp_path)
    assert failed.value.rank == 2
    first = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path)}
    assert max(first) == 3
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed" and record["resumed_from"]["step"] == 2
    resumed = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path)}
    assert sorted(resumed) == [1, 2, 3, 4]
    assert resumed[3] == first[3]

    # The step-2 checkpoint resumed under context parallel (cp=2, ep=1: the two do not compose yet): all-to-all
    # attention on the latent attention's queries, keys and narrower values trains the same losses.
    other = tmp_path / "at_cp2"
    shutil.copytree(tmp_path / "checkpoints" / "step_2", other / "checkpoints" / "step_2")
    record = run_experiment([*overrides, "parallel.ep=1", "parallel.cp=2", "checkpoint.export=none"], other)
    assert record["resumed_from"]["step"] == 2 and record["applied"]["cp"]["cp"] == 2
    at_cp2 = {r["step"]: r["train/loss"] for r in read_metrics(other)}
    assert sorted(at_cp2) == [3, 4]
    for step in (3, 4):
        assert abs(at_cp2[step] / resumed[step] - 1) < 1e-5, (step, at_cp2, resumed)

    state, model_cfg = load_checkpoint_model(tmp_path / "checkpoints" / "step_4")

    cfg = model_config(model_cfg)
    model = build_meta(cfg).to_empty(device="cpu")
    spec_for(cfg).init_buffers(model, torch.device("cpu"))
    model.load_state_dict(state, strict=False)  # the rotary tables are derived, not saved
    biases = [v for k, v in state.items() if k.endswith("expert_bias")]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="sdpa")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    print(f"export logits max |diff| {(ours - theirs).abs().max().item():.3g}")
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
