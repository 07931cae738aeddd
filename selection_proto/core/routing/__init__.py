"""Choosing and booking: the cost, queueing, selection, prefill/decode plans, a prefill's end read from events."""
