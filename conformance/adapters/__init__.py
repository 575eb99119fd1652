"""Backend adapters: map names a backend moved or renamed onto the design document's names.

See ``docs/conformance.md`` ("Adapters") for how to write one; ``upstream_0_1_1`` is the worked example.
"""
