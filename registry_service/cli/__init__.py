"""``adapterctl``: the operators' command line for the registry."""
