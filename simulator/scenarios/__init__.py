"""Scenario modules; each exposes `save(ctx)` and/or `load(ctx)` returning report rows."""
