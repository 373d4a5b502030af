"""The paged KV cache of the kernel contract: GQA pages (store, decode and prefill attention) and MLA latent
pages (store, decode attention), each a torch reference and path; the Triton launchers in `triton/`."""
