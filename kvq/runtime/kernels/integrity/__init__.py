"""The integrity checks over the KV pool's page tags: the page check (tags and hashes of sealed pages) and the
step check (the tags a step will write and read), each a torch reference and path, Triton on CUDA."""
