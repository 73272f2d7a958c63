"""Measurement: the metric schema, memory accounting and the sampled step's breakdown by phase, FLOPs,
peak FLOPS (measured on a CPU), MFU and HFU, and the profiled step's communication."""
