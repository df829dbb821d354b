"""Scale-out: engine replicas on Ray Serve, routed by who holds the prefix (optional extra `cluster`)."""
