"""`kvq bench ...`: measurements whose results are recorded in BENCHMARKS.md (never asserted in tests)."""
