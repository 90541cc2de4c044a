"""Training drafts: distillation and its data."""
