"""The words every part of the core speaks: errors, JSON, bytes, the request and response types, the route table, hashes, the settings, the counters, the state budget."""
