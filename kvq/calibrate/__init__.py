"""`kvq calibrate`: FP8 KV-cache scales measured by streaming decoder layers over real text."""
