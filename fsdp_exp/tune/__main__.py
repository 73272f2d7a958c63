"""``python -m fsdp_exp.tune [the run's overrides] [tune.*] [plan.device=<name>]`` (fsdp_exp.tune.cli)."""

import sys

from fsdp_exp.tune.cli import main

sys.exit(main())
