"""Triton kernels for the GPU fast path. Each has a torch reference elsewhere in the package (its
oracle and CPU fallback); tests run them on the CPU under TRITON_INTERPRET=1 at small shapes."""
