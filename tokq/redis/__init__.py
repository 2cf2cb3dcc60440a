"""Redis clients: connections (connection), pipelined script runs (pipeline), sharded pub/sub
(pubsub) and the embedded server for `tokq up` and the tests (embedded)."""
