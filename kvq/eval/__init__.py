"""`kvq eval`'s measurements: held-out text (perplexity, KL, top-1 agreement), MMLU and GSM-style tasks,
their 95% intervals, and the report (table and JSON) a model card quotes. Every number comes from the
kvq runtime decoding the checkpoint (`kvq.runtime.engine`)."""
