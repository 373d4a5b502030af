"""The names of the kernel choices an engine takes (`EngineConfig.kernels`, `EngineConfig.cpu_isa`): one
vocabulary for the settings, their command-line options and the kernels that resolve them. Imports nothing
(no torch: a command line validates its flags before torch loads)."""

BACKEND_CHOICES = ("auto", "torch", "triton")  # `kernels.backend`
# the CPU kernel paths, fastest first (`kernels.cpu.isa`): auto picks the first this CPU and build run
CPU_ISA_CHOICES = ("auto", "amx", "avx512bf16", "avx512", "avx2", "scalar", "torch")
