"""Reference models and data (a small GPT, its LightningModule and data, Hugging Face wrappers):
examples the library never imports."""
