"""Runtime model files, one per architecture; `registry` maps config.json's model_type to the class."""
