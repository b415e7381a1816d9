"""lpbench: low-precision LLM training benchmarks (BF16, FP8, MXFP8, NVFP4) side by side."""

__version__ = "0.1.0"
