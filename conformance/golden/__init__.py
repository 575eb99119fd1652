"""Golden checkpoints: small checkpoints every backend must load bit-exact."""
