"""The router's HTTP layer: app factory, route table, handlers, the relay to the client,
the server protocol with its client deadlines, auth, access log, admin and dashboard."""
