"""Builders of test and benchmark inputs: tiny random models, HF-layout checkpoints, embedded SmolLM2.

Import the submodules directly (`kvq.testing.checkpoint_fixtures`, `kvq.testing.smollm2`, ...); this
package imports nothing so that light modules such as `staging` stay light.
"""
