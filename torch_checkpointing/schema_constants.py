"""Constants shared by the schema and the layouts, kept apart to avoid an import cycle."""

RANK_PLACEHOLDER = "{rank}"
KEY_PATTERN = r"[a-zA-Z0-9_-]+"
