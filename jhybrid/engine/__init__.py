"""Engine: the jitted steps, the scheduler, and the `LLM` API."""

from jhybrid.engine.engine_config import EngineConfig
from jhybrid.engine.llm import LLM, generate
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jhybrid.engine.sampling import SamplingParams
from jhybrid.engine.structured_output import StructuredOutputsParams
from jhybrid.model_loader import LoadedModel, load

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "LoadedModel", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "generate", "load"]
