"""Text corpora for calibration and evaluation: the bundled Wikipedia articles, .txt and .jsonl files."""
