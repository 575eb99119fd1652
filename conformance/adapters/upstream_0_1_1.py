"""torch-checkpointing 0.1.1 renamed ``dtensor_resharder.DTensorResharder`` to ``default_resharder.DefaultResharder``.

Run with ``--backend-adapter conformance.adapters.upstream_0_1_1``. The import-location
clause IMPORT-RESHARD-1 still fails: an adapter does not move a name into the module the document names.
"""

from torch_checkpointing.default_resharder import DefaultResharder

DTensorResharder = DefaultResharder
