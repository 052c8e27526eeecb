"""The progress bar of `LLM.generate` / `LLM.chat` (`use_tqdm`): prompts done, as vLLM's "Processed prompts". Host
only (no JAX)."""

from __future__ import annotations

from typing import Any


class Progress:
    """A progress bar over the prompts (vLLM's "Processed prompts"), with input and output tokens/s."""

    def __init__(self, use_tqdm: bool | Any, groups: list[list]):
        self.bar, self.pending, self.num_in, self.num_out = None, list(groups), 0, 0
        if use_tqdm:
            from tqdm import tqdm

            make = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = make(total=len(groups), desc="Processed prompts", dynamic_ncols=True,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

    def advance(self) -> None:
        """Counts the prompts whose candidates have all finished since the last call."""
        if self.bar is None:
            return
        done = [seqs for seqs in self.pending if all(s.is_finished for s in seqs)]
        if done:
            self.pending = [seqs for seqs in self.pending if not all(s.is_finished for s in seqs)]
            self.num_in += sum(len(seqs[0].prompt_ids) for seqs in done)
            self.num_out += sum(len(s.output_ids) for seqs in done for s in seqs)
            elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.postfix = (f"est. speed input: {self.num_in / elapsed:.2f} toks/s, "
                                f"output: {self.num_out / elapsed:.2f} toks/s")
            self.bar.update(len(done))
