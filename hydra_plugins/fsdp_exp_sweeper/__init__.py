"""fsdp_exp's Hydra sweeper plugin (``hydra/sweeper=interleaved``, the default in conf/config.yaml).

Hydra's basic sweeper, with its jobs reordered so that repeats interleave: for ``sharding=full,grad_op
trainer.repeat=0,1`` it runs full/0, grad_op/0, full/1, grad_op/1 where the basic sweeper runs
full/0, full/1, grad_op/0, grad_op/1. Same jobs, same overrides per job, same ``params`` and
``max_batch_size`` options. Hydra instantiates sweepers only from the ``hydra_plugins`` namespace, so
the class is named here; fsdp_exp/sweep.py holds the ordering (``interleave_repeats``).
"""

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

from fsdp_exp.sweep import interleave_repeats


class InterleavedSweeper(BasicSweeper):
    """The cartesian product of the sweep's overrides, every configuration's repeat 0 first, then repeat 1..."""

    @staticmethod
    def split_arguments(overrides, max_batch_size):
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        jobs = interleave_repeats(jobs)
        if max_batch_size is None:
            return [jobs]
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))
