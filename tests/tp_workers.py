"""Worker functions for the tensor-parallel tests (spawned; they must live in an importable
module)."""
