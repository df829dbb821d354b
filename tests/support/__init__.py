"""Shared test support: what the machine has (machine.py) and a gateway served for real clients
(gateway_helpers.py). The tiny models, engine faults and the stub engine stay in bench/, whose soak, cluster
and HTTP benchmarks use them too."""
