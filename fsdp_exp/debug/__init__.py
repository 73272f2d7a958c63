"""The ``debug`` config group's code: what a run does on purpose to be checked.

- ``faults``: fault injection: a rank that raises, is signalled or turns its parameters NaN at the start
  of a step, or fails inside a save after writing its shards;
- ``init_check``: the identical-initialization check (``debug.check_identical_init``).

Importing the package loads the torch-free part only; import ``faults`` by name.
"""

from fsdp_exp.debug.init_check import compare_init_digests

__all__ = ["compare_init_digests"]
