"""Backend-agnostic conformance suite for the checkpointing design document.

Run ``pytest conformance/``; see ``conformance/README.md``.
"""
