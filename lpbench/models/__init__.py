"""Model zoo: one decoder implementation, architectures as data."""

from lpbench.models.decoder import Decoder, build_model, count_active_parameters, count_parameters
from lpbench.models.registry import MODELS, ModelConfig, get_model_config

__all__ = [
    "Decoder",
    "ModelConfig",
    "MODELS",
    "build_model",
    "count_active_parameters",
    "count_parameters",
    "get_model_config",
]
