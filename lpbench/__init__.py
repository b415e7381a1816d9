"""lpbench: low-precision LLM training benchmarks (BF16, FP8, MXFP8, NVFP4) side by side."""

from lpbench.threads import set_wait_policy as _set_wait_policy

__version__ = "0.1.0"
_set_wait_policy()  # before anything imports torch (lpbench/threads.py)
