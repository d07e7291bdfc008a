"""Parsers of a model's output text: tool calls (per model family) and reasoning (`<think>` blocks). Each
is a small state machine fed text deltas as they come, so a streamed answer and a whole one are parsed by
the same code; `output.OutputParser` chains them for one chat choice."""
