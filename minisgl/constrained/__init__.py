"""Structured outputs: grammars (JSON schema, regex, EBNF) that restrict which tokens may be sampled.

`check` parses a constraint without the model's tokenizer (the server's validation boundary calls it,
so a bad schema is a 400); `Grammars` is the scheduler's side: compilation off the scheduling loop, one
matcher per request, the batch's token bitmask (on the device, see `staging`); `apply_bitmask` masks the
logits before sampling (a Triton kernel on a GPU). xgrammar (PyPI) parses, compiles and matches grammars and
fills the masks; it is imported only once a constrained request arrives.
"""

from minisgl.constrained.grammar import Grammars, apply_bitmask, check

__all__ = ["Grammars", "apply_bitmask", "check"]
