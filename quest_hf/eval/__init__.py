"""Evaluation cores shared by `scripts/` and the tests (model-agnostic, no plotting)."""
