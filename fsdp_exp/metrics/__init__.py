"""Measurement: the metric schema, memory accounting, FLOPs and MFU."""
