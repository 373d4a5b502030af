"""GPTQ for `kvq compress --method gptq`: calibrated INT4 weights, decoder layers streamed from disk."""
