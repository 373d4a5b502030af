"""CPU kernels: the C extensions (`_linear`: W4A16, W8A16, W4A8, W8A8, dense AMX; `_ops`: norms, SiLU,
rotary, KV store, decode attention), the ISA choice, and the Python that binds them. Imports torch only."""
