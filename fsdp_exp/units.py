"""Units every layer shares (a leaf): bytes in a GiB. The metric names say ``_gib`` for this unit
(``fsdp_exp.metrics.schema``)."""

GIB = 2**30
