"""What the router has promised each rank: a prompt's hashes and load, bookings, tracking hashes, sessions, prefill ends."""
