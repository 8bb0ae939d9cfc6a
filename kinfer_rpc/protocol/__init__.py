"""The protocol layer: bytes and JSON. Framing (Content-Length frames <-> messages), the JSON-RPC
connection (ids, errors, cancellation, progress), params and results, and the server's lifecycle.
The only layer that knows JSON shapes; it calls the host."""
