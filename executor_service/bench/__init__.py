"""Benchmarks and stress runs of the executor, with their client processes (not product API).

Each runs the executor as its own process and its clients as other processes, the way a
backend meets it, and checks the answers it times.
"""
