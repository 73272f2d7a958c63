"""fsdp_exp's Hydra launcher plugin (``hydra/launcher=slurm``). Hydra instantiates launchers only from
the ``hydra_plugins`` namespace, so the class is named here; fsdp_exp/slurm.py holds the code."""

import fsdp_exp.slurm


class SlurmLauncher(fsdp_exp.slurm.SlurmLauncher):
    """Each job of a sweep is a SLURM job, one task per rank, sized by its own trainer config."""
