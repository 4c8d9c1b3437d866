"""Code both services use: configuration, the tensor codec, adapter references,
errors, logging and the gRPC server scaffolding. Knows no service, imports no GPU stack
at module level."""
