"""jhybrid: a JAX/Pallas inference engine for hybrid (linear + full attention) LLMs."""

from jhybrid.assets import default_model_path
from jhybrid.config import ModelConfig
from jhybrid.engine import (LLM, CompletionOutput, EngineConfig, Logprob, RequestOutput, SamplingParams,
                            StructuredOutputsParams, generate)

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "Logprob", "ModelConfig", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "default_model_path", "generate"]
__version__ = "0.1.0"
