"""Contracts between the router and the engines: what each side writes and the other reads.
Pure data (msgspec + stdlib): no I/O, no framework, importable by router, proxy and shim."""
