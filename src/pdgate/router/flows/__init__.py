"""The P/D flows: pull (vLLM NixlConnector), notify (KV-ready over ZMQ) and push.

Reading path: `failover.py` (one retry loop for every flow) → `bodies.py` (the two legs'
bodies) → `common.py` (prefill leg off the critical path, relay, usage) → `pull.py`,
`notify.py`, `push.py` (what differs per mode) → `setup.py` (built per app).
"""
