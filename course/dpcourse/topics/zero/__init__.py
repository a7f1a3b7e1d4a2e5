"""Tools of notebook 10 (ZeRO and FSDP): flat units, memory accounting, checks, torch's own APIs."""
