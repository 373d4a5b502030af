"""Pure tensor transforms for the on-disk weight formats kvq reads and writes (no I/O here)."""
