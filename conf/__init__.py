"""fsdp_exp's config groups. Installed as the package ``fsdp_exp.conf`` (setup.py maps this folder to it),
which is where Hydra looks (``pkg://fsdp_exp.conf``): the ``__init__.py`` is what makes Hydra accept
the package as a config source."""
