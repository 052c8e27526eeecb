"""jhybrid: a JAX/Pallas inference engine for hybrid (linear + full attention) LLMs."""

from jhybrid.config import ModelConfig
from jhybrid.engine.generate import GenerationOutput, generate

__all__ = ["GenerationOutput", "ModelConfig", "generate"]
__version__ = "0.1.0"
