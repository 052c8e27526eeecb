"""Engine: the jitted steps, the scheduler, and the `LLM` API."""

from jhybrid.engine.engine_config import EngineConfig
from jhybrid.engine.llm import LLM, RequestOutput, generate
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.sampling import SamplingParams
from jhybrid.model_loader import LoadedModel, load

__all__ = ["EngineConfig", "LLM", "LLMEngine", "LoadedModel", "RequestOutput", "SamplingParams", "generate", "load"]
