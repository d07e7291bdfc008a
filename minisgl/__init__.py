"""minisgl: a compact, fast LLM inference engine in the spirit of SGLang."""

from minisgl.core import SamplingParams
from minisgl.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
