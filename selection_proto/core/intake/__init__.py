"""KV events coming in: streams and their lifecycle, a batch applied, snapshots."""
