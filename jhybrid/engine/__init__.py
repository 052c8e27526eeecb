"""Engine: the jitted steps, the scheduler, and the `LLM` API."""

from jhybrid.engine.generate import LoadedModel, SequenceRunner, generate, load
from jhybrid.engine.llm import LLM, RequestOutput
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "LoadedModel", "RequestOutput", "SamplingParams", "SequenceRunner", "generate", "load"]
