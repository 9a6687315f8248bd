"""qosgate's benchmark suite: `python -m bench <scenario> [--quick]` (see bench/__main__.py)."""
