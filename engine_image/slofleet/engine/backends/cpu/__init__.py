"""The CPU backend: the engine's C++ kernels (every .cpp/.h here, built at run time by kernel_library.py and called
through cpu_kernels.py), the GGUF forms they read (quant.py), the dtype probe (dtype_probe.py), a step's layers in
one call (layer_stack.py), and the operations and attention the model calls (ops.py, attention.py)."""
