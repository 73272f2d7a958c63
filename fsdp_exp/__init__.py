"""fsdp_exp: measure sharded data-parallel training configurations, one Hydra command per experiment.

python -m fsdp_exp                                   # the default experiment (tiny Llama, 2 ranks)
python -m fsdp_exp model=llama7b sharding=full precision=bf16 trainer.nproc_per_node=8
"""

__version__ = "0.1.0"
