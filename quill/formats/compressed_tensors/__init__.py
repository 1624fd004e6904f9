"""compressed-tensors (llm-compressor) checkpoints: the config scheme and the reader."""
