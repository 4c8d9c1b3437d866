"""The adapter registry: metadata in SQL, weights in a blob store, served over gRPC.
Needs no GPU stack."""
