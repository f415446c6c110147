"""Plumbing the router, the proxy and the shim share that is not a contract: tracing setup,
log format, secret files, the bearer-key check and the metrics registry."""
