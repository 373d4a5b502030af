"""`kvq push`: check that a folder is a complete kvq output, write its model card from the manifest and a
`kvq eval --json` report, and upload it to the Hugging Face Hub with huggingface_hub."""
