"""Engine: the jitted steps and the host loop that drives them."""

from jhybrid.engine.generate import GenerationOutput, SequenceRunner, generate

__all__ = ["GenerationOutput", "SequenceRunner", "generate"]
