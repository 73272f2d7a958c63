"""``python -m fsdp_exp.plan <run overrides> [plan.format=json] [plan.device=<name>] [plan.margin=<f>]``"""

import sys

from fsdp_exp.plan.cli import main

sys.exit(main())
