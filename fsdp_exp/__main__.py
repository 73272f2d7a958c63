"""``python -m fsdp_exp [overrides]``: compose the config with Hydra, validate it, launch the ranks.

    python -m fsdp_exp                                         # tiny Llama, FSDP2 full shard, 2 ranks
    python -m fsdp_exp sharding=grad_op precision=bf16 trainer.steps=50
    python -m fsdp_exp --cfg job                               # print the composed config and exit
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from fsdp_exp.config import ConfigError, to_run_config

EXIT_BAD_CONFIG = 2
EXIT_RUN_FAILED = 1


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_entry(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from fsdp_exp.launch import RunFailed, launch, report_failure

    hc = HydraConfig.get()
    meta = {"overrides": list(hc.overrides.task), "choices": {k: v for k, v in hc.runtime.choices.items()
                                                               if not k.startswith("hydra")}}
    try:
        launch(to_run_config(cfg), Path(hc.runtime.output_dir), meta)
    except ConfigError as err:
        print(f"fsdp_exp: invalid configuration: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    except RunFailed as failure:
        report_failure(failure)
        sys.exit(EXIT_RUN_FAILED)


def main() -> None:
    hydra_entry()


if __name__ == "__main__":
    main()
