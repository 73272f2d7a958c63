"""Hydra config groups of fsdp_exp (a package so that the compose API can find it)."""
