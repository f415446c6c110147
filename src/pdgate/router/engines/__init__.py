"""The engine client: the only part of the router that speaks HTTP to engines and parses
their replies (HTTP/1.1 pool, SSE checks, error mapping)."""
