"""Data shipped with lpbench: recommended_model_configs.csv (see lpbench.bench.recommended)."""
