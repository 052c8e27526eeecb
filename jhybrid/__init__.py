"""jhybrid: a JAX/Pallas inference engine for hybrid (linear + full attention) LLMs."""

from jhybrid.config import ModelConfig
from jhybrid.engine import LLM, RequestOutput, SamplingParams, generate

__all__ = ["LLM", "ModelConfig", "RequestOutput", "SamplingParams", "generate"]
__version__ = "0.1.0"
