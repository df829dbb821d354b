"""Recorded (and, for Open WebUI, source-built) client traffic: one JSON file per client flow, replayed by
tests/gateway/test_replay.py, recorded by scripts/record_client_traffic.py; traffic.py reads both."""
