"""The serving path across processes: gRPC front ends and the GPU engine, meeting over a local
socket (small descriptors) and shared memory (the tensors)."""
