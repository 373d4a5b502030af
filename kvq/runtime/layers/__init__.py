"""Building blocks the model files share: linear layers over stored weights, norms, rotary, attention,
experts."""
