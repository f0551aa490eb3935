"""Training frameworks other than the Hugging Face Trainer (each imported lazily, as an optional extra)."""
