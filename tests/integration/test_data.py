"""Real data: loading, tokenization, packing, the distributed sampler, resume, overlap, evaluation,
and bad input refused before any rank starts.

Coverage and resume call the data classes directly for each rank (the sampler needs no process
group); one real 2-rank run trains on the shipped corpus and shows the loss falling.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate
from fsdp_exp.data import build_data, prepare_data
from fsdp_exp.data.loader import StepData
from fsdp_exp.data.tokenizer import ByteTokenizer

from conftest import REPO, leftover_processes, read_metrics, run_cli, run_config, run_experiment

CPU = torch.device("cpu")
CORPUS = REPO / "fsdp_exp" / "data" / "corpus"
TRAIN_DOCS = [d for d in (CORPUS / "train.txt").read_text().split("\n\n") if d.strip()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One packed-data cache for the module: packing the shipped corpus once serves every test."""
    return tmp_path_factory.mktemp("data_cache")


def _setup(cache: Path, overrides: list[str] = (), world: int = 2):
    cfg = run_config(["data=text", f"data.cache_dir={cache}", f"trainer.nproc_per_node={world}", *overrides])
    topology = validate(cfg, cuda_devices=0)
    prepare_data(cfg, log=None)
    return cfg, topology


def _rows(batch) -> torch.Tensor:
    """A micro-batch back as its (micro, seq_len + 1) token blocks."""
    return torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)


def _global_stream(cfg, topology, steps: int, start: int = 0) -> torch.Tensor:
    """Every rank's micro-batches of ``steps`` steps, laid out as the global batches: ranks in order,
    each rank's slice contiguous (the contract of the sampler)."""
    ranks = [build_data(cfg, topology, r, CPU) for r in range(topology.dp_size)]
    out = []
    for step in range(start, start + steps):
        for data in ranks:
            out += [_rows(b) for b in data.micro_batches(step)]
    return torch.cat(out)


def _block_ids(stream: torch.Tensor, blocks: np.ndarray) -> list[int]:
    index = {row.tobytes(): i for i, row in enumerate(blocks.astype(np.int64))}
    assert len(index) == len(blocks), "blocks must be distinguishable for this test"
    return [index[row.numpy().tobytes()] for row in stream]


# ------------------------------------------------------------------------------- loading, packing
def test_packing_cuts_the_token_stream_with_document_separators(cache):
    cfg, topology = _setup(cache)
    data = build_data(cfg, topology, 0, CPU)
    blocks = np.asarray(data.source.blocks, dtype=np.int64)
    L = cfg.trainer.seq_len
    # The stream: every document's UTF-8 bytes, then the end-of-document id 0.
    stream = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), 0) for d in TRAIN_DOCS]).astype(np.int64)
    n = (len(stream) - 1) // L
    assert blocks.shape == (n, L + 1)
    for i in (0, 1, n // 2, n - 1):  # consecutive blocks overlap by one token: no (input, target) pair lost
        assert (blocks[i] == stream[i * L : i * L + L + 1]).all()
    meta = data.source.packed.meta
    assert meta["num_docs"] == len(TRAIN_DOCS) and meta["num_tokens"] == len(stream)
    assert (blocks == 0).sum() >= len(TRAIN_DOCS) - 2  # separators (the last ones fall in the dropped tail)
    assert ByteTokenizer().decode(blocks[0]).startswith("The lighthouse keeper")


def test_packing_is_done_once_and_cached(cache, tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("\n\n".join(TRAIN_DOCS[:10]))
    overrides = [f"data.files=[{corpus}]", "data.val_files=[]", "trainer.seq_len=64"]
    cfg = run_config(["data=text", f"data.cache_dir={cache}", *overrides])
    first = prepare_data(cfg, log=None)["train"]
    again = prepare_data(cfg, log=None)["train"]
    assert first["built_now"] and not again["built_now"] and again["path"] == first["path"]
    # Another seq_len is another packing; so is a changed file.
    other = prepare_data(
        run_config(["data=text", f"data.cache_dir={cache}", *overrides[:2], "trainer.seq_len=32"]), log=None
    )["train"]
    assert other["built_now"] and other["path"] != first["path"]
    corpus.write_text("\n\n".join(TRAIN_DOCS[:12]))
    changed = prepare_data(cfg, log=None)["train"]
    assert changed["built_now"] and changed["num_docs"] == 12


def test_text_json_parquet_hub_folder_and_streaming_give_the_same_blocks(cache, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d.strip() for d in TRAIN_DOCS[:20]]
    (tmp_path / "d.txt").write_text("\n\n".join(docs))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
    hub = tmp_path / "hub_dataset"  # a local dataset folder: the same load_dataset(name, split=...) path as the hub
    hub.mkdir()
    (hub / "train.jsonl").write_text((tmp_path / "d.jsonl").read_text())
    (hub / "validation.jsonl").write_text(json.dumps({"body": docs[0]}) + "\n")

    base = [f"data.cache_dir={cache}", "trainer.seq_len=64", "data.val_files=[]"]
    variants = {
        "text": ["data=text", f"data.files=[{tmp_path / 'd.txt'}]"],
        "json": ["data=json", f"data.files=[{tmp_path / 'd.jsonl'}]", "data.text_field=body"],
        "json-streaming": [
            "data=json",
            f"data.files=[{tmp_path / 'd.jsonl'}]",
            "data.text_field=body",
            "data.streaming=true",
        ],
        "parquet": ["data=parquet", f"data.files=[{tmp_path / 'd.parquet'}]", "data.text_field=body"],
        "hf-folder": [
            "data=hf",
            f"data.dataset={hub}",
            "data.split=train",
            "data.val_split=null",
            "data.text_field=body",
            "data.max_blocks=null",
        ],
        "hf-folder-streaming": [
            "data=hf",
            f"data.dataset={hub}",
            "data.split=train",
            "data.val_split=null",
            "data.text_field=body",
            "data.max_blocks=null",
            "data.streaming=true",
        ],
    }
    blocks = {}
    for name, overrides in variants.items():
        cfg = run_config([*overrides, *base])
        validate(cfg, cuda_devices=0)
        info = prepare_data(cfg, log=None)
        blocks[name] = np.fromfile(Path(info["train"]["path"]) / "blocks.bin", dtype=np.uint16)
        assert info["train"]["num_docs"] == len(docs), name
    for name, value in blocks.items():
        assert np.array_equal(value, blocks["text"]), name

    # data.max_blocks packs a prefix of the same stream.
    cfg = run_config([*variants["hf-folder-streaming"], *base[:2], "data.max_blocks=9"])
    info = prepare_data(cfg, log=None)["train"]
    assert info["num_blocks"] == 9
    prefix = np.fromfile(Path(info["path"]) / "blocks.bin", dtype=np.uint16)
    assert np.array_equal(prefix, blocks["text"][: prefix.size])


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A real BPE tokenizer (the `tokenizers` library) with 400 tokens, trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TRAIN_DOCS,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_packs_with_its_end_of_document_token(cache, bpe_tokenizer):
    from tokenizers import Tokenizer

    cfg, topology = _setup(cache, [f"data.tokenizer={bpe_tokenizer}", "model.vocab_size=512"])
    data = build_data(cfg, topology, 0, CPU)
    meta = data.source.packed.meta
    tok = Tokenizer.from_file(str(bpe_tokenizer))
    assert meta["vocab_size"] == 400 and meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert meta["num_tokens"] < 0.6 * len("".join(TRAIN_DOCS).encode())  # BPE: fewer tokens than bytes
    first = np.asarray(data.source.blocks[0], dtype=np.int64)
    assert first.max() < 400
    assert tok.decode(first.tolist()).startswith("The lighthouse keeper")
    # The folder holding tokenizer.json works too, and it is the same tokenizer.
    cfg2, _ = _setup(cache, [f"data.tokenizer={bpe_tokenizer.parent}", "model.vocab_size=512"])
    assert prepare_data(cfg2, log=None)["train"]["num_blocks"] == meta["num_blocks"]


# ---------------------------------------------------------------------------------- the sampler
def test_every_block_exactly_once_per_epoch_on_2_and_4_ranks(cache):
    cfg1, top1 = _setup(cache, ["trainer.global_batch_size=8"], world=1)
    blocks = np.asarray(build_data(cfg1, top1, 0, CPU).source.blocks)
    n = len(blocks)
    assert n % 8, "the corpus should not divide the batch: epochs then meet inside a global batch"
    steps = 2 * n // 8 + 1  # a little over two epochs
    reference = _global_stream(cfg1, top1, steps)
    epochs = None
    for world, micro in ((2, 2), (4, 1)):  # 2 ranks x 2 micro-batches of 2; 4 ranks x 2 micro-batches of 1
        cfg, topology = _setup(cache, ["trainer.global_batch_size=8", f"trainer.micro_batch_size={micro}"], world)
        assert topology.grad_accum_steps == 2
        stream = _global_stream(cfg, topology, steps)
        # The same global order at any world size, and each rank's share is different data.
        assert torch.equal(stream, reference)
        ids = _block_ids(stream, blocks)
        epochs = [ids[:n], ids[n : 2 * n]]
        for epoch in epochs:
            assert sorted(epoch) == list(range(n))  # every packed block exactly once per epoch
        step0 = [ids[r * 8 // world : (r + 1) * 8 // world] for r in range(world)]
        assert len({i for share in step0 for i in share}) == 8
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # a new shuffle each epoch

    # Deterministic by seed: the same seed gives the same order, another seed another one.
    again = _global_stream(cfg1, top1, 3)
    other_cfg, other_top = _setup(cache, ["trainer.global_batch_size=8", "data.seed=7"], world=1)
    assert torch.equal(again, reference[:24])
    assert not torch.equal(_global_stream(other_cfg, other_top, 3), again)
    unshuffled_cfg, unshuffled_top = _setup(cache, ["trainer.global_batch_size=8", "data.shuffle=false"], world=1)
    assert _block_ids(_global_stream(unshuffled_cfg, unshuffled_top, 2), blocks) == list(range(16))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_the_same_batches(cache, num_workers):
    overrides = [
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        f"data.num_workers={num_workers}",
        "trainer.steps=50",
    ]
    cfg, topology = _setup(cache, overrides, world=2)
    total, stop = 50, 23  # an epoch is 313 blocks / 8 = 39.1 steps: stop mid-epoch 0, run into epoch 1

    def batches(data, steps):
        return [[_rows(b) for b in data.micro_batches(s)] for s in steps]

    for rank in range(2):
        uninterrupted = batches(build_data(cfg, topology, rank, CPU), range(total))

        first = build_data(cfg, topology, rank, CPU)
        before = batches(first, range(stop))
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint would store
        first.close()
        assert state["step"] == stop and state["epoch"] == 0 and state["position_in_epoch"] == stop * 8

        resumed = build_data(cfg, topology, rank, CPU)  # a fresh process would build exactly this
        resumed.load_state_dict(state)
        after = batches(resumed, range(stop, total))
        assert resumed.state_dict()["epoch"] == 1
        for got, want in zip(before + after, uninterrupted, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    # A position saved on other data is refused rather than silently continuing something else.
    other_cfg, other_top = _setup(cache, [*overrides, "trainer.seq_len=64"], world=2)
    with pytest.raises(ValueError, match="fingerprint"):
        build_data(other_cfg, other_top, 0, CPU).load_state_dict(state)


class _SlowSource:
    """Rows that take ``delay`` seconds to load (a slow disk, a heavy decode)."""

    num_rows, fingerprint = None, "slow"

    def __init__(self, delay: float):
        self.delay = delay

    def rows(self, first: int, count: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.arange(first, first + count).unsqueeze(1).repeat(1, 9)

    def documents(self, first: int, count: int) -> torch.Tensor:
        return torch.zeros((count, 9), dtype=torch.int32)  # one document a row


def test_workers_overlap_loading_with_compute_and_data_time_shows_starvation(cache):
    def mean_wait(num_workers: int) -> tuple[float, list[int]]:
        cfg = run_config(
            [
                "trainer.global_batch_size=2",
                "trainer.steps=8",
                f"data.num_workers={num_workers}",
                "data.prefetch_factor=2",
            ]
        )
        topology = validate(cfg, cuda_devices=0)
        data = StepData(_SlowSource(0.05), cfg, topology, dp_rank=1, device=CPU)
        waits, seen = [], []
        for step in range(8):
            seen += [int(b.inputs[0, 0]) for b in data.micro_batches(step)]
            time.sleep(0.1)  # the step's compute, slower than loading
            waits.append(data.last_wait_s)
        data.close()
        return sum(waits[2:]) / 6, seen

    starved, order = mean_wait(0)
    overlapped, order_workers = mean_wait(2)
    assert order == order_workers == [2 * s + 1 for s in range(8)]  # rank 1's slice of each global batch
    assert starved > 0.045  # every step waits for its load
    assert overlapped < 0.02, overlapped  # workers loaded it during the previous step's compute


# ------------------------------------------------------------------------------- training for real
@pytest.mark.slow
def test_two_rank_run_on_the_corpus_learns_and_logs_val_loss(cache, tmp_path):
    overrides = [
        "data=text",
        f"data.cache_dir={cache}",
        "trainer.steps=200",
        "trainer.warmup_steps=5",
        "trainer.eval_every=100",
        "optim.lr=3e-3",
        "data.num_workers=1",
        "logger.wandb.mode=disabled",
    ]
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed"
    assert record["data"]["train"]["num_blocks"] > 300 and record["data"]["val"]["val_batches"] == 4
    metrics = read_metrics(tmp_path)
    losses = [m["train/loss"] for m in metrics]
    assert len(losses) == 200
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)  # untrained: uniform over the 256 bytes
    assert sum(losses[-10:]) / 10 < 0.6 * losses[0], (losses[0], losses[-10:])
    evals = [m for m in metrics if "val/loss" in m]
    assert [m["step"] for m in evals] == [100, 200]
    for m in evals:
        assert m["val/perplexity"] == pytest.approx(math.exp(m["val/loss"]))
    assert evals[1]["val/loss"] < evals[0]["val/loss"] < 0.6 * losses[0]
    # the last evaluation in the run's summary (run.json, W&B, the console's table): issue #43 item 8
    assert record["summary"]["summary/val_loss"] == evals[-1]["val/loss"]
    assert record["summary"]["summary/val_perplexity"] == evals[-1]["val/perplexity"]
    for m in metrics:
        assert 0 <= m["perf/data_time_s"] < m["perf/step_time_s"]


# ------------------------------------------------------------------------------------- bad input
def _refused(overrides: list[str], run_dir: Path) -> str:
    """The launcher refuses before spawning: a ConfigError, and nothing written in the run folder."""
    with pytest.raises(ConfigError) as err:
        run_experiment(overrides, run_dir)
    assert not (run_dir / "run.json").exists() and not (run_dir / "metrics.jsonl").exists()
    return str(err.value)


def test_missing_file_is_refused_before_workers_spawn(cache, tmp_path):
    message = _refused(
        ["data=text", f"data.cache_dir={cache}", f"data.files=[{tmp_path / 'nope.txt'}]"], tmp_path / "run"
    )
    assert "nope.txt" in message and "does not exist" in message and "fix: pass data.files=" in message
    message = _refused(["data=json", f"data.cache_dir={cache}", f"data.files=[{tmp_path}/*.jsonl]"], tmp_path / "run")
    assert "matches no file" in message


def test_empty_file_is_refused_before_workers_spawn(cache, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    message = _refused(
        ["data=text", f"data.cache_dir={cache}", f"data.val_files=[{tmp_path / 'empty.txt'}]"], tmp_path / "run"
    )
    assert "empty.txt is empty" in message and "data.val_files" in message
    # Text that is all blank lines has no document: it cannot fill one block.
    (tmp_path / "blank.txt").write_text("\n\n   \n\n")
    message = _refused(
        ["data=text", f"data.cache_dir={cache}", f"data.files=[{tmp_path / 'blank.txt'}]"], tmp_path / "run"
    )
    assert "yields 0 tokens" in message and "fewer than one global batch" in message


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(cache, tmp_path, bpe_tokenizer):
    message = _refused(["data=text", f"data.cache_dir={cache}", f"data.tokenizer={bpe_tokenizer}"], tmp_path / "run")
    assert "vocabulary of 400 tokens" in message and "model.vocab_size=256" in message
    assert "fix: pass model.vocab_size=400" in message


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["trainer.eval_every=5", "data.val_files=[]"], "pass data.val_files="),
        (["data=json", "data.text_field=body"], "pass data.text_field=<one of id, text>"),
        (["trainer.seq_len=256", "trainer.global_batch_size=256"], "fewer than one global batch"),
        (["data.tokenizer=/no/such/tokenizer.json"], "pass data.tokenizer=byte"),
        (["data=synthetic", "trainer.eval_every=5"], "pass trainer.eval_every=0"),
        (["data=hf", "data.dataset=./no/such/folder"], "data.dataset="),
    ],
)
def test_other_bad_data_configs_name_the_fix(cache, tmp_path, overrides, needle):
    assert needle in _refused(["data=text", f"data.cache_dir={cache}", *overrides], tmp_path / "run")


def test_bad_data_on_the_command_line_exits_2_without_a_traceback(tmp_path):
    result = run_cli(
        ["data=text", f"data.cache_dir={tmp_path / 'cache'}", f"data.files=[{tmp_path / 'nope.txt'}]"], tmp_path / "run"
    )
    assert result.returncode == 2, result.stderr
    assert "does not exist" in result.stderr and "fix: pass data.files=" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert leftover_processes(tmp_path / "run") == []


# ------------------------------------------------------------------------------- synthetic intact
def test_synthetic_tokens_are_unchanged():
    cfg = run_config(["trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.seq_len=16"])
    topology = validate(cfg, cuda_devices=0)
    data = build_data(cfg, topology, 1, CPU)
    got = [_rows(b) for b in data.micro_batches(3)]
    # The original definition: sample i is drawn from a generator seeded by (seed, i); rank 1 of 2
    # takes samples 4..7 of each global batch of 8.
    for j, rows in enumerate(got):
        for k, row in enumerate(rows):
            i = 3 * 8 + 4 + 2 * j + k
            gen = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + i)
            assert torch.equal(row, torch.randint(0, cfg.model.vocab_size, (17,), generator=gen))
    assert data.last_wait_s >= 0 and data.state_dict()["step"] == 4
